"""Dense projections and embeddings with logically named fp32 master weights.

Weights are stored in `param_dtype` (float32 masters) and cast to the compute dtype before use;
the cast happens on the stored shard, so ZeRO-3 all-gathers compute-dtype bytes.
"""

import math

import jax
import jax.numpy as jnp
from flax import linen as nn

from angel_jax.sharding import constrain


class Linear(nn.Module):
    """Contracts the last `len(axes) - len(features)` dims of x with a kernel.

    `axes` names every kernel dimension, inputs first: e.g. ("embed", "heads", "head_dim").
    """

    features: tuple[int, ...]
    axes: tuple[str, ...]
    dtype: jnp.dtype = jnp.bfloat16
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        n_in = len(self.axes) - len(self.features)
        in_shape = x.shape[x.ndim - n_in :]
        init = nn.initializers.normal(stddev=1.0 / math.sqrt(math.prod(in_shape)))
        kernel = self.param(
            "kernel",
            nn.with_logical_partitioning(init, self.axes),
            (*in_shape, *self.features),
            self.param_dtype,
        )
        kernel = constrain(kernel.astype(self.dtype), self.axes)
        contract = (tuple(range(x.ndim - n_in, x.ndim)), tuple(range(n_in)))
        return jax.lax.dot_general(x.astype(self.dtype), kernel, (contract, ((), ())))


class Embed(nn.Module):
    """Token embedding table ("vocab", "embed"); `attend` reuses it as a tied LM head."""

    vocab_size: int
    features: int
    dtype: jnp.dtype = jnp.bfloat16
    param_dtype: jnp.dtype = jnp.float32

    def setup(self):
        self.embedding = self.param(
            "embedding",
            nn.with_logical_partitioning(nn.initializers.normal(stddev=0.02), ("vocab", "embed")),
            (self.vocab_size, self.features),
            self.param_dtype,
        )

    def _table(self) -> jax.Array:
        return constrain(self.embedding.astype(self.dtype), ("vocab", "embed"))

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return jnp.take(self._table(), tokens, axis=0)

    def attend(self, x: jax.Array) -> jax.Array:
        return jnp.einsum("...d,vd->...v", x.astype(self.dtype), self._table())
