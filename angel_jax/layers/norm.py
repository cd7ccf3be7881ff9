"""RMSNorm, computed in float32 whatever the activation dtype."""

import jax
import jax.numpy as jnp
from flax import linen as nn


class RMSNorm(nn.Module):
    eps: float = 1e-5
    dtype: jnp.dtype = jnp.bfloat16
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param(
            "scale",
            nn.with_logical_partitioning(nn.initializers.ones, ("embed",)),
            (x.shape[-1],),
            self.param_dtype,
        )
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
        # The scale is used in the compute dtype, like every weight, so that a compute-dtype
        # copy of the params (ZeRO-Cache) computes exactly what the float32 masters do.
        return (x32 * scale.astype(self.dtype).astype(jnp.float32)).astype(self.dtype)


class LayerNorm(nn.Module):
    """LayerNorm with scale and bias (GPT-2, BERT), computed in float32."""

    eps: float = 1e-5
    dtype: jnp.dtype = jnp.bfloat16
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        param = lambda name, init: self.param(
            name,
            nn.with_logical_partitioning(init, ("embed",)),
            (x.shape[-1],),
            self.param_dtype,
        )
        scale, bias = param("scale", nn.initializers.ones), param("bias", nn.initializers.zeros)
        x32 = x.astype(jnp.float32)
        x32 = x32 - jnp.mean(x32, axis=-1, keepdims=True)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
        # Weights in the compute dtype, as RMSNorm does.
        as_f32 = lambda w: w.astype(self.dtype).astype(jnp.float32)
        return (x32 * as_f32(scale) + as_f32(bias)).astype(self.dtype)
