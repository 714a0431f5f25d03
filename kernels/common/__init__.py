"""Helpers shared by every backend (row flattening, tolerances of kernels, block sizes)."""
