"""Backends of forgeax: `xla` (references), `triton`, `pallas` (gpu/ and tpu/).

Users never import these directly: `forgeax.ops` selects among them. Each backend
module exposes one `Implementation` per op, which `forgeax.ops` loads lazily by
module path, so `import forgeax` needs only jax.
"""
