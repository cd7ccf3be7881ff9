"""Pallas kernels, each beside its pure-JAX reference: flash-attention blocks for ring attention
(`flash_block`) and block-scaled FP8 quantization for FP8 collectives (`fp8`)."""
