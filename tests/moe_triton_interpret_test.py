"""The moe_mlp suite with the Triton ragged_dot backend in Triton's interpreter (its own process:
TRITON_INTERPRET=1 must be set before `import triton`; FORGEAX_TEST_BACKENDS=triton)."""

from moe_test import *  # noqa: F403 - the same tests, another backend set
