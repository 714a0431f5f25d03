"""The attention conformance suite, for the Triton backend in Triton's interpreter.

Its own process because TRITON_INTERPRET=1 must be set before `import triton`;
BUILD sets FORGEAX_TEST_BACKENDS=triton (the other backends run in //tests:attention_test).
"""

from attention_test import *  # noqa: F403 - the same tests, another backend set
