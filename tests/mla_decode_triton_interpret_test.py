"""The mla_decode conformance suite, for the Triton backend in Triton's interpreter.

Triton's interpreter exists only if TRITON_INTERPRET=1 is set before `import
triton`, so this suite runs in its own process (Bazel target); BUILD sets
FORGEAX_TEST_BACKENDS=triton so that only the Triton backend is collected here
(the other backends run in //tests:mla_decode_test).
"""

from mla_decode_test import *  # noqa: F403 - the same tests, another backend set
