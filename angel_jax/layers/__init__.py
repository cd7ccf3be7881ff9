"""Transformer building blocks: pure Flax modules that name their axes, never mesh axes."""

from angel_jax.layers.attention import Attention, RopeScaling, apply_rope
from angel_jax.layers.linear import Embed, Linear
from angel_jax.layers.mlp import SwiGLU
from angel_jax.layers.norm import RMSNorm

__all__ = ["Attention", "Embed", "Linear", "RMSNorm", "RopeScaling", "SwiGLU", "apply_rope"]
