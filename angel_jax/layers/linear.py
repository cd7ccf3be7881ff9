"""Dense projections and embeddings with logically named fp32 master weights.

Weights are stored in `param_dtype` (float32 masters) and cast to the compute dtype before use;
the cast happens on the stored shard, so ZeRO-3 all-gathers compute-dtype bytes. With `fp8`, a
projection runs on FP8 GEMMs (`angel_jax/fp8.py`): e4m3 inputs and weight, e5m2 output
gradient. With `lora` the projection adds a LoRA adapter's low-rank update (angel_jax/lora.py).
"""

import math

import jax
import jax.numpy as jnp
from flax import linen as nn

from angel_jax import fp8
from angel_jax.lora import LoRA
from angel_jax.parallel.embedding import vocab_parallel_take
from angel_jax.parallel.fp8_collectives import zero3_dot
from angel_jax.sharding import (
    active_mesh,
    active_spec,
    constrain,
    gather_layouts,
    gather_param,
    in_partly_manual_region,
    regather,
)


class Linear(nn.Module):
    """Contracts the last `len(axes) - len(features)` dims of x with a kernel.

    `axes` names every kernel dimension, inputs first: e.g. ("embed", "heads", "head_dim").
    """

    features: tuple[int, ...]
    axes: tuple[str, ...]
    dtype: jnp.dtype = jnp.bfloat16
    param_dtype: jnp.dtype = jnp.float32
    fp8: bool = False
    fp8_gather: bool = False  # ZeRO-3's all-gather of the kernel in FP8 (zero3_dot).
    use_bias: bool = False  # A bias over the output dims (GPT-2, BERT), named like them.
    lora: LoRA | None = None  # A LoRA adapter beside the kernel.

    @nn.compact
    def __call__(self, x: jax.Array, x8=None) -> jax.Array:
        """`x8`: x's FP8 copy made by the caller (`gathered_input`), for an FP8 projection."""
        y = self._project(x, x8)
        if self.lora:
            y = y + self._adapter(x)
        if not self.use_bias:
            return y
        out_axes = self.axes[len(self.axes) - len(self.features) :]
        bias = self.param(
            "bias",
            nn.with_logical_partitioning(nn.initializers.zeros, out_axes),
            self.features,
            self.param_dtype,
        )
        return y + constrain(bias.astype(self.dtype), out_axes)

    def _project(self, x: jax.Array, x8) -> jax.Array:
        n_in = len(self.axes) - len(self.features)
        in_shape = x.shape[x.ndim - n_in :]
        init = nn.initializers.normal(stddev=1.0 / math.sqrt(math.prod(in_shape)))
        kernel = self.param(
            "kernel",
            nn.with_logical_partitioning(init, self.axes),
            (*in_shape, *self.features),
            self.param_dtype,
        )
        x, w = x.astype(self.dtype), kernel.astype(self.dtype)
        if self.fp8_gather and active_mesh() is not None:
            return zero3_dot(x, w, self.axes, n_in, self.fp8)
        w = gather_param(w, self.axes)
        if self.fp8:
            return fp8.matmul(x, w, n_in, x8=x8)
        return jax.lax.dot_general(x, w, fp8.dims(x.ndim, w.ndim, n_in)[0])

    def _adapter(self, x: jax.Array) -> jax.Array:
        """scale * (x A) B: A (in..., rank) split like the kernel's inputs, B (rank, out...)
        like its outputs, the rank whole. B starts at zero: the base projection's output."""
        n_in = len(self.axes) - len(self.features)
        in_shape, rank = x.shape[x.ndim - n_in :], self.lora.rank
        a_axes, b_axes = (*self.axes[:n_in], None), (None, *self.axes[n_in:])
        init = nn.initializers.normal(stddev=1.0 / math.sqrt(math.prod(in_shape)))
        a = self.param(
            "lora_a",
            nn.with_logical_partitioning(init, a_axes),
            (*in_shape, rank),
            self.param_dtype,
        )
        b = self.param(
            "lora_b",
            nn.with_logical_partitioning(nn.initializers.zeros, b_axes),
            (rank, *self.features),
            self.param_dtype,
        )
        x = x.astype(self.dtype)
        if self.lora.dropout and self.has_rng("dropout"):  # Training's apply passes a key.
            keep = jax.random.bernoulli(self.make_rng("dropout"), 1 - self.lora.dropout, x.shape)
            x = jnp.where(keep, x / (1 - self.lora.dropout), 0).astype(self.dtype)
        a, b = constrain(a.astype(self.dtype), a_axes), constrain(b.astype(self.dtype), b_axes)
        h = jax.lax.dot_general(x, a, fp8.dims(x.ndim, a.ndim, n_in)[0])
        return self.lora.scale * jax.lax.dot_general(h, b, fp8.dims(h.ndim, b.ndim, 1)[0])


def gathered_input(x: jax.Array, gather, fp8_matmul: bool) -> tuple[jax.Array, tuple | None]:
    """(x, x8) for projections of x that `gather` = (split, whole) logical axes: x arrives
    split (sequence parallel's norm region) and the dots want it whole. In bf16 x gathered
    (`regather`); for FP8 projections x stays split (their gradients meet there) and x8 is its
    FP8 copy, quantized on the split and gathered (`fp8.gather_quantized`), made once for them
    all. (x, None) where nothing is to be gathered (each projection quantizes x itself)."""
    layouts = gather and gather_layouts(x, *gather)
    if not layouts or layouts[0] == layouts[1]:
        return x, None
    if fp8_matmul:
        return x, fp8.gather_quantized(x, layouts)
    return regather(x, *gather), None


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
        mesh = active_mesh()
        if mesh is not None and in_partly_manual_region():
            # A pipeline stage: XLA's GPU partitioner aborts on this gather there.
            table_spec = active_spec(("vocab", "embed"))
            tokens_spec = active_spec(("batch", "length"))
            return vocab_parallel_take(self._table(), tokens, mesh, table_spec, tokens_spec)
        return jnp.take(self._table(), tokens, axis=0)

    def attend(self, x: jax.Array, fp8_matmul: bool = False) -> jax.Array:
        if fp8_matmul:
            return fp8.matmul(x.astype(self.dtype), self._table().T)
        return jnp.einsum("...d,vd->...v", x.astype(self.dtype), self._table())
