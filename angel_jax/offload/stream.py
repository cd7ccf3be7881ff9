"""The streamed optimizer update of ZeRO-Cache: state visits the device one chunk at a time.

Masters and optimizer state live in pinned host memory, with each stacked layer weight (leading
"layers" axis) kept as one array per layer: a chunk is one array, so the update can read it,
write its successor into the same donated host buffer, and let XLA overlap one chunk's copies
with another's update. The device holds a few chunks at a time instead of the whole state.
"""

import jax
import jax.numpy as jnp

from angel_jax.optim import Optimizer

Space = jax.memory.Space  # Memory spaces inside jit: Device and Host (pinned).


def unstack(tree, stacked):
    """Splits each stacked leaf of a params-shaped `tree` into a tuple of per-layer leaves."""
    return jax.tree.map(lambda x, s: tuple(x) if s else x, tree, stacked)


def unstack_like(tree, stacked, like):
    """`unstack` for trees whose leaves are subtrees (e.g. per-parameter optimizer states);
    `like` is the params tree, whose structure is their prefix."""

    def split(param, sub, is_stacked):
        if not is_stacked:
            return sub
        # Stacked weights' states are vmapped over layers: every leaf has the layer axis.
        return tuple(jax.tree.map(lambda x, i=i: x[i], sub) for i in range(param.shape[0]))

    return jax.tree.map(split, like, tree, stacked)


def _to(space, tree):
    return jax.tree.map(lambda x: jax.device_put(x, space), tree)


def streamed_update(
    optimizer: Optimizer, grads, state, masters, stacked, compute_dtype, in_flight: int = 2
):
    """Updates host-resident, unstacked `masters` and `state` with device-resident `grads`.

    At most `in_flight` chunks are on the device at once: chunk k's copy to the device waits
    (an optimization barrier) until chunk k - in_flight is updated, else XLA's scheduler would
    start every copy early and hold the whole state on the device.
    Returns (masters, state) as host-memory values of the same layout, the new masters stacked
    in `compute_dtype` on the device, and the global grad norm.
    """
    grads, norm = optimizer.clip(grads)
    # Flatten to chunks: (path, grad, state, master) with stacked weights split per layer.
    treedef = jax.tree.structure(grads)
    chunks, shapes = [], []
    for (path, grad), leaf_state, master, is_stacked in zip(
        jax.tree_util.tree_leaves_with_path(grads),
        treedef.flatten_up_to(state),
        treedef.flatten_up_to(masters),
        treedef.flatten_up_to(stacked),
        strict=True,
    ):
        if is_stacked:
            chunks += [(path, grad[i], leaf_state[i], master[i]) for i in range(len(master))]
            shapes.append(len(master))
        else:
            chunks.append((path, grad, leaf_state, master))
            shapes.append(None)

    done = []  # Per chunk: (new master on host, new state on host, new compute copy).
    for k, (path, grad, chunk_state, master) in enumerate(chunks):
        if k >= in_flight:
            chunk_state, master, _ = jax.lax.optimization_barrier(
                (chunk_state, master, done[k - in_flight][2])
            )
        new_master, new_state = optimizer.update_leaf(
            path, grad, _to(Space.Device, chunk_state), jax.device_put(master, Space.Device)
        )
        done.append(
            (
                jax.device_put(new_master, Space.Host),
                _to(Space.Host, new_state),
                new_master.astype(compute_dtype),
            )
        )

    # Regroup the chunks into the trees' layouts.
    outs, k = [], 0
    for layers in shapes:
        if layers is None:
            outs.append(done[k])
            k += 1
        else:
            group = done[k : k + layers]
            k += layers
            outs.append(
                (
                    tuple(m for m, _, _ in group),
                    tuple(s for _, s, _ in group),
                    jnp.stack([c for _, _, c in group]),
                )
            )
    part = lambda i: treedef.unflatten([o[i] for o in outs])
    return part(0), part(1), part(2), norm
