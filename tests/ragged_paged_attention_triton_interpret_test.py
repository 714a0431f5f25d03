"""The ragged_paged_attention suite for the Triton backend in Triton's interpreter.

Triton's interpreter exists only if TRITON_INTERPRET=1 is set before `import triton`, so this
suite runs in its own process (Bazel target); the target sets FORGEAX_TEST_BACKENDS=triton so
that only the Triton backend is collected here (the others run in
//tests:ragged_paged_attention_test).
"""

from ragged_paged_attention_test import *  # noqa: F403 - the same tests, another backend set
