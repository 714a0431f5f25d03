"""The user-kernel example's tests with its Triton kernel in Triton's interpreter.

TRITON_INTERPRET=1 must be set before `import triton`, so this runs in its own process
(Bazel target); FORGEAX_TEST_BACKENDS=triton collects only the Triton backend.
"""

from custom_kernel_example_test import *  # noqa: F403 - the same tests, another backend set
