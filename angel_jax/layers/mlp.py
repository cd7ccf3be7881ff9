"""SwiGLU feed-forward: Megatron column-parallel gate/up, row-parallel down."""

import functools

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax.ad_checkpoint import checkpoint_name

from angel_jax import lora
from angel_jax.layers.linear import Linear, gathered_input
from angel_jax.sharding import constrain


class SwiGLU(nn.Module):
    ffn_dim: int
    dtype: jnp.dtype = jnp.bfloat16
    fp8: bool = False  # Projections through FP8 (Linear.fp8).
    fp8_gather: bool = False  # ZeRO-3 all-gathers of their kernels in FP8 (Linear.fp8_gather).
    adapters: lora.LoRA | None = None  # LoRA on the projections its targets name (gate, up, down).
    gather: tuple | None = None  # x's (split, whole) logical axes (linear.gathered_input).

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        d_model = x.shape[-1]
        linear = functools.partial(
            Linear, dtype=self.dtype, fp8=self.fp8, fp8_gather=self.fp8_gather
        )
        on = lambda target: lora.on(self.adapters, target)
        x, x8 = gathered_input(x, self.gather, self.fp8 and not self.fp8_gather)
        gate = linear((self.ffn_dim,), ("embed", "mlp"), lora=on("gate"), name="gate")(x, x8)
        up = linear((self.ffn_dim,), ("embed", "mlp"), lora=on("up"), name="up")(x, x8)
        gate, up = checkpoint_name((gate, up), "mlp_in")
        h = constrain(jax.nn.silu(gate) * up, ("batch", "length", "mlp"))
        return linear((d_model,), ("mlp", "embed"), lora=on("down"), name="down")(h)


ACTIVATIONS = {
    "gelu": functools.partial(jax.nn.gelu, approximate=False),  # BERT.
    "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True),  # GPT-2's "gelu_new".
    "relu": jax.nn.relu,  # T5 (v1.0).
}


class DenseMLP(nn.Module):
    """The classic two-matrix feed-forward (GPT-2, BERT, T5): wi, activation, wo; Megatron
    column-parallel wi, row-parallel wo."""

    ffn_dim: int
    activation: str = "gelu"  # A key of ACTIVATIONS.
    use_bias: bool = True
    dtype: jnp.dtype = jnp.bfloat16

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        linear = functools.partial(Linear, dtype=self.dtype, use_bias=self.use_bias)
        h = linear((self.ffn_dim,), ("embed", "mlp"), name="wi")(x)
        h = checkpoint_name(h, "mlp_in")
        h = constrain(ACTIVATIONS[self.activation](h), ("batch", "length", "mlp"))
        return linear((x.shape[-1],), ("mlp", "embed"), name="wo")(h)
