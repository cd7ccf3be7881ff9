"""Pallas kernels (flash-attention blocks, FP8 quantization), each beside a pure-JAX reference.

Empty until the long-context and FP8 issues land.
"""
