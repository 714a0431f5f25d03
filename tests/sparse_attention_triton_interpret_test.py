"""The sparse_attention conformance suite, for the Triton backend in Triton's interpreter.

Triton's interpreter exists only if TRITON_INTERPRET=1 is set before `import triton`, so this
suite runs in its own process (Bazel target) with FORGEAX_TEST_BACKENDS=triton: only the Triton
backend is collected here (the others run in //tests:sparse_attention_test).
"""

from sparse_attention_test import *  # noqa: F403 - the same tests, another backend set
