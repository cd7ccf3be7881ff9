"""The streamed update's programs (`GroupPrograms`): the jitted update of a group of chunks,
one per sequence of chunks alike, shared by the groups alike."""

import re

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from angel_jax.offload.masters import LOW, compute_copy, join
from angel_jax.optim import Optimizer

Space = jax.memory.Space  # Memory spaces inside jit: Device and Host (pinned).


def fetch_f32(grad):
    """A grad chunk on the device in float32, wherever it was."""
    return jax.device_put(grad, Space.Device).astype(jnp.float32)


class GroupPrograms:
    """The jitted updates of the groups of `chunks` (`stream.Chunk`s), made as first needed
    (`get`) and kept (`len` says how many)."""

    def __init__(self, optimizer: Optimizer, chunks: list, parts: list[str]):
        self.optimizer, self.chunks = optimizer, chunks
        self._fns = {}
        # Per chunk, what its update's program depends on: its path but for the number of the
        # params' part (an unrolled layer's), whether it is a stacked weight's layer, and its
        # master's and state's shapes and shardings (`get`'s key).
        self.alike = [
            (
                re.sub(r"\d+", "#", part),
                jax.tree_util.keystr(c.path[1:]),
                c.layer is None,
                c.master,
                jax.tree.structure(c.state),
                tuple(jax.tree.leaves(c.state)),
            )
            for c, part in zip(chunks, parts, strict=True)
        ]

    def __len__(self) -> int:
        return len(self._fns)

    def get(self, ks: list[int], grads: list, compute: list, parts: bool = False):
        """The jitted update of a group of chunks: one program per sequence of weights alike
        (and whether each grad is stacked), not per layer, so groups alike share it: a
        stacked weight's layers, and unrolled layers' weights (their paths alike but for the
        layer's number, their shapes and shardings alike). It writes the new compute copy
        into `compute`'s arrays (donated), or with `parts` returns each chunk's part of it
        (`StreamedUpdate.stages`' `into_new`) and reads `compute` only. A split master (its
        low half, `masters.LOW`) is joined with its part of `compute` before its update and
        split after it."""
        group = [self.chunks[k] for k in ks]
        # Stacked grads: the program picks the layer.
        indexed = [g.ndim > c.master.ndim for g, c in zip(grads, group, strict=True)]
        weights = list(dict.fromkeys(c.weight for c in group))
        position = {w: i for i, w in enumerate(weights)}
        key = (
            parts,
            *(
                (
                    self.alike[k],
                    position[c.weight],
                    i,
                    jax.typeof(compute[c.weight]),
                    compute[c.weight].sharding,
                )
                for k, c, i in zip(ks, group, indexed, strict=True)
            ),
        )
        if key not in self._fns:
            self._fns[key] = self._jitted(group, indexed, weights, compute, parts)
        return self._fns[key]

    def _jitted(self, group: list, indexed: list[bool], weights: list[int], compute, parts):
        """`get`'s program for `group` (its chunks), jitted."""
        dtypes = {w: compute[w].dtype for w in weights}

        def update(grads, layers, scale, masters, states, computes):
            computes = dict(zip(weights, computes, strict=True))
            new_masters, new_states, new_parts = [], [], []
            for c, is_indexed, grad, layer, master, state in zip(
                group, indexed, grads, layers, masters, states, strict=True
            ):
                if is_indexed:
                    grad = jax.lax.dynamic_index_in_dim(grad, layer, keepdims=False)
                target = computes[c.weight]
                if master.dtype == LOW:
                    old = target
                    if c.layer is not None:
                        old = jax.lax.dynamic_index_in_dim(target, layer, keepdims=False)
                    master = join(master, old)
                master, state = self.optimizer.update_leaf(
                    c.path, fetch_f32(grad) * scale, state, master
                )
                home, new = compute_copy(master, c.master.dtype, dtypes[c.weight])
                new_masters.append(home)
                new_states.append(state)
                if parts:
                    new_parts.append(new)
                    continue
                if c.layer is not None:
                    new = jax.device_put(new, jax.typeof(target).memory_space)
                    new = jax.lax.dynamic_update_index_in_dim(target, new, layer, 0)
                computes[c.weight] = new
            if parts:
                return new_masters, new_states, new_parts
            return new_masters, new_states, [computes[w] for w in weights]

        if parts:
            outs = [part_sharding(compute[c.weight].sharding, c.layer) for c in group]
        else:
            outs = [compute[w].sharding for w in weights]
        return jax.jit(
            update,
            out_shardings=(
                [c.master_sharding for c in group],
                [c.state_sharding for c in group],
                outs,
            ),
            # The compute copies are updated in place, or only read (`parts`).
            donate_argnums=(3, 4) if parts else (3, 4, 5),
        )


def part_sharding(sharding: NamedSharding, layer: int | None) -> NamedSharding:
    """The sharding of a chunk's part of a compute copy of `sharding`: a layer of a stacked
    weight (the leading axis gone), or the weight whole."""
    if layer is None:
        return sharding
    return sharding.update(spec=P(*tuple(sharding.spec)[1:]))
