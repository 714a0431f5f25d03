"""The linear_cross_entropy conformance suite, for the Triton backend in Triton's interpreter.

Its own process because TRITON_INTERPRET=1 must be set before `import triton`;
BUILD sets FORGEAX_TEST_BACKENDS=triton (xla and xla_chunked run in
//tests:linear_cross_entropy_test).
"""

from linear_cross_entropy_test import *  # noqa: F403 - the same tests, another backend set
