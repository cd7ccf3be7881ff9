"""The token embedding's lookup inside a pipeline stage, one device at a time.

In a region manual over `pipeline` only, XLA's GPU partitioner aborts on a gather from a table
split over `tensor` by indices split over another axis (jax 0.11.2; CPU devices compile it).
Here each device looks its tokens up in its own rows of the table (Megatron's vocab-parallel
embedding): a token outside them gives zeros, and a sum over the table's vocab axes gives every
device each token's row.
"""

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from angel_jax.sharding import shard_map_mesh


def _axes(entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def vocab_parallel_take(table_VD, tokens_BT, mesh, table_spec: P, tokens_spec: P):
    """`jnp.take(table_VD, tokens_BT, axis=0)` with the table laid out by `table_spec` (vocab,
    embed) and the tokens by `tokens_spec`, in a region manual over every mesh axis."""
    vocab_axes = _axes(table_spec[0])
    if set(vocab_axes) & {a for e in tokens_spec for a in _axes(e)}:
        raise ValueError(f"tokens {tokens_spec} split over the table's vocab axes {vocab_axes}")

    def local(table_VD, tokens_BT):
        rows = table_VD.shape[0]
        shard = 0  # This device's block of the vocabulary, major to minor as the spec's axes.
        for axis in vocab_axes:
            shard = shard * jax.lax.axis_size(axis) + jax.lax.axis_index(axis)
        ids = tokens_BT - shard * rows
        mine = (ids >= 0) & (ids < rows)
        h_BTD = jnp.take(table_VD, jnp.clip(ids, 0, rows - 1), axis=0)
        h_BTD = jnp.where(mine[..., None], h_BTD, jnp.zeros((), h_BTD.dtype))
        return jax.lax.psum(h_BTD, vocab_axes) if vocab_axes else h_BTD

    return jax.shard_map(
        local,
        mesh=shard_map_mesh(mesh),
        in_specs=(table_spec, tokens_spec),
        out_specs=P(*tokens_spec, table_spec[1]),
    )(table_VD, tokens_BT)
