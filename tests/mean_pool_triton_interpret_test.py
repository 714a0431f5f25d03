"""The mean_pool conformance suite, for the Triton backend in Triton's interpreter.

Triton's interpreter exists only if TRITON_INTERPRET=1 is set before `import triton`, so this
suite runs in its own process (Bazel target) with FORGEAX_TEST_BACKENDS=triton (the other
backends run in //tests:mean_pool_test).
"""

from mean_pool_test import *  # noqa: F403 - the same tests, another backend set
