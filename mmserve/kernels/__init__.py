"""Triton GPU kernels."""
