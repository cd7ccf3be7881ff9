"""Positions and masks for the classic families and for packed sequences.

Packed sequences carry segment ids: tokens of one document share an id (1, 2, ...), padding has
id 0. A token attends only to tokens of its own segment, and its position counts from its
document's first token, so a packed row computes what its documents would alone.

Letters: B batch, T query length, S key length, N heads.
"""

import math

import jax
import jax.numpy as jnp
from flax import linen as nn

from angel_jax.sharding import constrain


def segment_mask(q_segments_BT: jax.Array, k_segments_BS: jax.Array) -> jax.Array:
    """(B, T, S) bool: query and key are in the same segment."""
    return q_segments_BT[:, :, None] == k_segments_BS[:, None, :]


def segment_positions(segments_BT: jax.Array) -> jax.Array:
    """(B, T) int32: each token's index within its segment (a new segment starts wherever the
    id changes)."""
    index = jnp.broadcast_to(jnp.arange(segments_BT.shape[1]), segments_BT.shape)
    starts = jnp.concatenate(
        [jnp.ones_like(segments_BT[:, :1], bool), segments_BT[:, 1:] != segments_BT[:, :-1]],
        axis=1,
    )
    first = jax.lax.cummax(jnp.where(starts, index, 0), axis=1)
    return (index - first).astype(jnp.int32)


def relative_bucket(relative_TS: jax.Array, bidirectional: bool, buckets: int, max_distance: int):
    """T5's bucket of each key-minus-query offset: exact for small offsets, logarithmic up to
    `max_distance`, beyond it the last bucket; a bidirectional half for each sign."""
    bucket = jnp.zeros_like(relative_TS)
    if bidirectional:
        buckets //= 2
        bucket = jnp.where(relative_TS > 0, buckets, 0)
        distance = jnp.abs(relative_TS)
    else:  # Only the past: offsets <= 0.
        distance = jnp.maximum(-relative_TS, 0)
    exact = buckets // 2
    # In Hugging Face's order of operations, so imported models pick the same buckets.
    log_ratio = jnp.log(jnp.maximum(distance, 1).astype(jnp.float32) / exact)
    far = exact + (log_ratio / math.log(max_distance / exact) * (buckets - exact)).astype(jnp.int32)
    far = jnp.minimum(far, buckets - 1)
    return bucket + jnp.where(distance < exact, distance, far)


class RelativePositionBias(nn.Module):
    """T5's learned bias per (offset bucket, head), added to the attention scores: (1, N, T,
    S) float32, or (B, N, T, S) with per-row `positions`."""

    num_heads: int
    bidirectional: bool
    buckets: int = 32
    max_distance: int = 128

    @nn.compact
    def __call__(self, q_positions: jax.Array, k_positions: jax.Array) -> jax.Array:
        table = self.param(
            "embedding",
            nn.with_logical_partitioning(nn.initializers.normal(0.02), (None, "heads")),
            (self.buckets, self.num_heads),
            jnp.float32,
        )
        q = q_positions if q_positions.ndim == 2 else q_positions[None]
        k = k_positions if k_positions.ndim == 2 else k_positions[None]
        relative = k[:, None, :] - q[:, :, None]  # (B, T, S).
        bucket = relative_bucket(relative, self.bidirectional, self.buckets, self.max_distance)
        bias_BTSN = jnp.take(table, bucket, axis=0)
        return constrain(bias_BTSN.transpose(0, 3, 1, 2), (None, "heads", None, None))
