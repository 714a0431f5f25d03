"""The ragged_dot conformance suite, for the Triton backend in Triton's interpreter.

Triton's interpreter exists only if TRITON_INTERPRET=1 is set before `import triton`, so this
suite runs in its own process (Bazel target); FORGEAX_TEST_BACKENDS=triton collects only the
Triton backend here (the XLA backends run in //tests:ragged_dot_test).
"""

from ragged_dot_test import *  # noqa: F403 - the same tests, another backend set
