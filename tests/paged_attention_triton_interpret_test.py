"""The paged_attention / decode_attention suite, for the Triton backend in Triton's interpreter.

Triton's interpreter exists only if TRITON_INTERPRET=1 is set before `import triton`, so this
suite runs in its own process (Bazel target); BUILD sets FORGEAX_TEST_BACKENDS=triton so that
only the Triton backend is collected here (the other backends run in //tests:paged_attention_test).
"""

from paged_attention_test import *  # noqa: F403 - the same tests, another backend set
