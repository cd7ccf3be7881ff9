"""Causal grouped-query attention with rotary positions.

Megatron split: Q/K/V projections are column-parallel over heads, the output projection is
row-parallel, so tensor parallel needs one reduction per attention block.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax.ad_checkpoint import checkpoint_name

from angel_jax import lora, sharding
from angel_jax.config import ConfigError
from angel_jax.kernels import traced_attention
from angel_jax.layers.linear import Linear, gathered_input
from angel_jax.mesh import CONTEXT
from angel_jax.parallel.attention import (
    per_device_attention,
    sequence_parallel_attention,
    zigzag_order,
)
from angel_jax.sharding import constrain


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE for contexts beyond training's: `linear` divides every frequency by `factor`;
    `llama3` (Llama 3.1) divides those whose wavelength exceeds original_max_positions /
    low_freq_factor, keeps those under original_max_positions / high_freq_factor, and blends
    the band between."""

    kind: str = "none"  # none | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_positions: int = 8192


def rope_frequencies(half: int, theta: float, scaling: RopeScaling = RopeScaling()) -> jax.Array:
    """The `half` rotation frequencies (radians per position) of a head dim of 2 x half."""
    freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    if scaling.kind == "linear":
        return freq / scaling.factor
    if scaling.kind == "llama3":
        wavelength = 2 * math.pi / freq
        old = scaling.original_max_positions
        blend = (old / wavelength - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        blended = (1 - blend) * freq / scaling.factor + blend * freq
        long, short = (
            wavelength > old / scaling.low_freq_factor,
            wavelength < old / scaling.high_freq_factor,
        )
        return jnp.where(long, freq / scaling.factor, jnp.where(short, freq, blended))
    return freq


def apply_rope(
    x_BTNH: jax.Array, positions_T: jax.Array, theta: float, scaling: RopeScaling = RopeScaling()
) -> jax.Array:
    """Rotary embedding, rotate-half convention (as in Hugging Face Llama)."""
    freq = rope_frequencies(x_BTNH.shape[-1] // 2, theta, scaling)
    # Positions (T,) shared by the batch, or (B, T) (packed documents each start at 0).
    angle_BTH = positions_T.astype(jnp.float32)[..., None] * freq
    angle_BTH = angle_BTH if angle_BTH.ndim == 3 else angle_BTH[None]
    cos, sin = jnp.cos(angle_BTH)[:, :, None, :], jnp.sin(angle_BTH)[:, :, None, :]
    x1, x2 = jnp.split(x_BTNH.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BTNH.dtype)


def _require_whole_sequence(split, extras, cross: bool, causal: bool) -> None:
    """Fails early, naming the fix, where the sequence is split over devices but the attention
    needs all of it on each: masks, biases or positions (`extras`), cross or bidirectional."""
    if split and (any(e is not None for e in extras) or cross or not causal):
        raise ConfigError(
            "attention masks, biases, per-document positions, cross and bidirectional "
            "attention (config.data.packing, BERT, T5) need the whole sequence per device: "
            "set config.mesh.context=1 and config.mesh.sequence=1"
        )


def _rope_positions(length: int, positions, split, mesh) -> jax.Array:
    """The tokens' positions for RoPE in the order the model sees them: `positions` or 0..T-1,
    in ring attention's zigzag order where the context axis splits the sequence."""
    if positions is None:
        positions = jnp.arange(length)
    if split and CONTEXT in (split if isinstance(split, tuple) else (split,)):
        # Ring attention's zigzag: the model sees its tokens in this order.
        positions = jnp.asarray(zigzag_order(length, mesh.shape[CONTEXT]))
    return positions


def _split_kv_heads_like_queries(k_BTKH, v_BTKH, groups: int):
    """Keys and values pinned to the tensor layout of the query heads they serve (`groups` of
    them per KV head)."""
    if sharding.rule("kv_heads") != sharding.rule("heads"):
        # KV heads are replicated where query heads are split (fewer KV heads than tensor
        # ranks): repeat them to one per query head so both split the same way.
        k_BTKH = jnp.repeat(k_BTKH, groups, axis=2)
        v_BTKH = jnp.repeat(v_BTKH, groups, axis=2)
        kv_axes = ("batch", "length", "heads", "head_dim")
    else:
        kv_axes = ("batch", "length", "kv_heads", "head_dim")
    return constrain(k_BTKH, kv_axes), constrain(v_BTKH, kv_axes)


def _whole_sequence_attention(
    q_BTNH, k_BTNH, v_BTNH, mesh, mask_BTS, bias_NTS, *, scale, causal, implementation
):
    """Attention with the whole sequence on each device. In a pipeline stage beside other split
    axes (a region manual over `pipeline` only), cuDNN's call cannot be partitioned: each
    device then calls it on its own rows and heads (`per_device_attention`)."""
    in_a_stage = mesh is not None and sharding.in_partly_manual_region()
    traced = traced_attention(implementation)
    if in_a_stage and implementation == "cudnn" and mask_BTS is None and bias_NTS is None:
        spec = sharding.active_spec(("batch", "length", "heads", "head_dim"))
        return per_device_attention(
            q_BTNH, k_BTNH, v_BTNH, mesh, spec, scale=scale, causal=causal, implementation=traced
        )
    mask = None if mask_BTS is None else mask_BTS[:, None]  # (B, 1, T, S).
    return jax.nn.dot_product_attention(
        q_BTNH,
        k_BTNH,
        v_BTNH,
        bias=bias_NTS,
        mask=mask,
        scale=scale,
        is_causal=causal,
        implementation=traced,
    )


class Attention(nn.Module):
    """Letters: B batch, T length, D model dim, N query heads, K kv heads, H head dim."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    implementation: str | None = None  # jax.nn.dot_product_attention's: None (XLA) or "cudnn".
    dtype: jnp.dtype = jnp.bfloat16
    ring_blocks: str = "xla"  # Ring attention's block kernels (context axis): xla|cudnn|tokamax.
    fp8: bool = False  # Projections through FP8 (Linear.fp8).
    fp8_gather: bool = False  # ZeRO-3 all-gathers of their kernels in FP8 (Linear.fp8_gather).
    # The classic families (GPT-2, BERT, T5) turn these off or on.
    rope: bool = True  # Rotary positions on queries and keys.
    causal: bool = True
    use_bias: bool = False  # Biases on the projections.
    scale: float | None = None  # Of the scores; None: 1 / sqrt(head_dim) (T5 uses 1).
    rope_scaling: RopeScaling = RopeScaling()
    adapters: lora.LoRA | None = None  # LoRA on the projections its targets name (q, k, v, o).
    gather: tuple | None = None  # x's (split, whole) logical axes (linear.gathered_input).

    @nn.compact
    def __call__(
        self,
        x_BTD: jax.Array,
        kv_BSD: jax.Array | None = None,
        mask_BTS: jax.Array | None = None,
        bias_NTS: jax.Array | None = None,
        positions: jax.Array | None = None,
        cache: tuple | None = None,
    ):
        """Self-attention over x, or cross-attention to `kv_BSD`. `mask_BTS` (bool, True:
        may attend; e.g. same packed document), `bias_NTS` (added to the scores, e.g. T5's
        relative positions; (1 or B, N, T, S)) and `positions` ((T,) or (B, T), for RoPE) need
        the whole sequence on each device (no context or sequence split).

        Decoding: with `cache` = (k (B, S, K, H), v, start) the T new tokens are at positions
        start.., their keys and values are written into the cache, and they attend causally
        over it; returns (out, (k, v)), the caches updated."""
        n, k, h = self.num_heads, self.num_kv_heads, self.head_dim
        linear = functools.partial(
            Linear,
            dtype=self.dtype,
            fp8=self.fp8,
            fp8_gather=self.fp8_gather,
            use_bias=self.use_bias,
        )
        cross = kv_BSD is not None
        x_BTD, x8 = gathered_input(x_BTD, self.gather, self.fp8 and not self.fp8_gather)
        kv_BSD, kv8 = (kv_BSD, None) if cross else (x_BTD, x8)
        on = lambda target: lora.on(self.adapters, target)
        q_kernel, kv_kernel = ("embed", "heads", "head_dim"), ("embed", "kv_heads", "head_dim")
        q_BTNH = linear((n, h), q_kernel, lora=on("q"), name="query")(x_BTD, x8)
        k_BTKH = linear((k, h), kv_kernel, lora=on("k"), name="key")(kv_BSD, kv8)
        v_BTKH = linear((k, h), kv_kernel, lora=on("v"), name="value")(kv_BSD, kv8)
        q_BTNH, k_BTKH, v_BTKH = checkpoint_name((q_BTNH, k_BTKH, v_BTKH), "qkv")
        out_kernel = ("heads", "head_dim", "embed")
        out = linear((x_BTD.shape[-1],), out_kernel, lora=on("o"), name="out")
        if cache is not None:
            o_BTNH, cache = self._attend_cached(q_BTNH, k_BTKH, v_BTKH, *cache)
            return out(o_BTNH), cache
        mesh, split = sharding.active_mesh(), sharding.rule("length")
        _require_whole_sequence(
            split, (mask_BTS, bias_NTS, positions), cross=cross, causal=self.causal
        )
        positions = _rope_positions(x_BTD.shape[1], positions, split, mesh)
        q_BTNH, k_BTKH = self._rotate(q_BTNH, k_BTKH, positions)
        q_BTNH = constrain(q_BTNH, ("batch", "length", "heads", "head_dim"))
        k_BTKH, v_BTKH = _split_kv_heads_like_queries(k_BTKH, v_BTKH, n // k)
        if split:  # The sequence is split over devices: ring and/or Ulysses attention.
            spec = sharding.active_spec(("batch", "length", "heads", "head_dim"))
            o_BTNH = sequence_parallel_attention(
                q_BTNH,
                k_BTKH,
                v_BTKH,
                mesh,
                spec,
                implementation=self.implementation,
                ring_blocks=self.ring_blocks,
            )
        else:
            o_BTNH = _whole_sequence_attention(
                q_BTNH,
                k_BTKH,
                v_BTKH,
                mesh,
                mask_BTS,
                bias_NTS,
                scale=self.scale,
                causal=self.causal,
                implementation=self.implementation,
            )
        o_BTNH = checkpoint_name(
            constrain(o_BTNH, ("batch", "length", "heads", "head_dim")), "attn_out"
        )
        return out(o_BTNH)

    def _rotate(self, q_BTNH, k_BTKH, positions):
        """Queries and keys with the rotary embedding of `positions` (if the layer has it)."""
        if not self.rope:
            return q_BTNH, k_BTKH
        rotate = lambda x: apply_rope(x, positions, self.rope_theta, self.rope_scaling)
        return rotate(q_BTNH), rotate(k_BTKH)

    def _attend_cached(self, q_BTNH, new_k, new_v, k_BSKH, v_BSKH, start):
        """The new tokens' attention over the cache, after writing their keys and values
        into it at `start`: (o (B, T, N, H), (k, v)). XLA's attention: a few new tokens."""
        positions = start + jnp.arange(q_BTNH.shape[1])
        q_BTNH, new_k = self._rotate(q_BTNH, new_k, positions)
        k_BSKH = jax.lax.dynamic_update_slice_in_dim(k_BSKH, new_k.astype(k_BSKH.dtype), start, 1)
        v_BSKH = jax.lax.dynamic_update_slice_in_dim(v_BSKH, new_v.astype(v_BSKH.dtype), start, 1)
        visible_TS = jnp.arange(k_BSKH.shape[1])[None, :] <= positions[:, None]
        o_BTNH = jax.nn.dot_product_attention(
            q_BTNH.astype(k_BSKH.dtype),
            k_BSKH,
            v_BSKH,
            mask=visible_TS[None, None],
            scale=self.scale,
        )
        return o_BTNH.astype(self.dtype), (k_BSKH, v_BSKH)
