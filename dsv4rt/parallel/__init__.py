"""Several GPUs of one host: the parallel layout, its simulated collectives and the sharded reference."""
from .layout import Layout, LayoutError, stored_bytes, stored_slices

__all__ = ["Layout", "LayoutError", "stored_bytes", "stored_slices"]
