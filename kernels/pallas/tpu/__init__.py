"""Mosaic TPU kernels (pl.pallas_call with TPU compiler params)."""
