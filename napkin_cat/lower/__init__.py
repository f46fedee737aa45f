"""Lowering to numba.cuda."""
