"""Pallas kernels where no library has one, each beside its pure-JAX reference: block-scaled FP8
quantization for FP8 collectives (`fp8`). Attention and grouped GEMMs come from tokamax
(angel_jax/kernels.py)."""
