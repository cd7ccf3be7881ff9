"""SwiGLU feed-forward: Megatron column-parallel gate/up, row-parallel down."""

import functools

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax.ad_checkpoint import checkpoint_name

from angel_jax.layers.linear import Linear
from angel_jax.sharding import constrain


class SwiGLU(nn.Module):
    ffn_dim: int
    dtype: jnp.dtype = jnp.bfloat16
    fp8: bool = False  # Projections through FP8 (Linear.fp8).
    fp8_gather: bool = False  # ZeRO-3 all-gathers of their kernels in FP8 (Linear.fp8_gather).

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        d_model = x.shape[-1]
        linear = functools.partial(
            Linear, dtype=self.dtype, fp8=self.fp8, fp8_gather=self.fp8_gather
        )
        gate = linear((self.ffn_dim,), ("embed", "mlp"), name="gate")(x)
        up = linear((self.ffn_dim,), ("embed", "mlp"), name="up")(x)
        gate, up = checkpoint_name((gate, up), "mlp_in")
        h = constrain(jax.nn.silu(gate) * up, ("batch", "length", "mlp"))
        return linear((d_model,), ("mlp", "embed"), name="down")(h)
