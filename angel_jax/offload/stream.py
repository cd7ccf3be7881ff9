"""The streamed optimizer update of ZeRO-Cache: state visits the device one chunk at a time.

Masters and optimizer state live in pinned host memory, with each stacked layer weight (leading
"layers" axis) kept as one array per layer: a chunk is one array, so the update can read it,
write its successor into the same donated host buffer, and let XLA overlap one chunk's copies
with another's update. The device holds a few chunks at a time instead of the whole state.
"""

import jax

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
        layer = lambda i: jax.tree.map(lambda x: x[i] if x.ndim else x, sub)  # Counts stay.
        return tuple(layer(i) for i in range(param.shape[0]))

    return jax.tree.map(split, like, tree, stacked)


def _to(space, tree):
    return jax.tree.map(lambda x: jax.device_put(x, space), tree)


def streamed_update(optimizer: Optimizer, grads, state, masters, stacked, compute_dtype):
    """Updates host-resident, unstacked `masters` and `state` with device-resident `grads`.

    Returns (masters, state) as host-memory values of the same layout, the new masters stacked
    in `compute_dtype` on the device, and the global grad norm.
    """
    grads, norm = optimizer.clip(grads)

    def chunk(path, grad, chunk_state, master):
        new_master, new_state = optimizer.update_leaf(
            path, grad, _to(Space.Device, chunk_state), jax.device_put(master, Space.Device)
        )
        out = (jax.device_put(new_master, Space.Host), _to(Space.Host, new_state))
        return out, new_master.astype(compute_dtype)

    def one(path, grad, leaf_state, master, is_stacked):
        if not is_stacked:
            (new_master, new_state), compute = chunk(path, grad, leaf_state, master)
            return new_master, new_state, compute
        layers = [chunk(path, grad[i], leaf_state[i], master[i]) for i in range(len(master))]
        new_master = tuple(m for (m, _), _ in layers)
        new_state = tuple(s for (_, s), _ in layers)
        return new_master, new_state, jax.numpy.stack([c for _, c in layers])

    out = jax.tree_util.tree_map_with_path(one, grads, state, masters, stacked)
    part = lambda i: jax.tree.map(lambda _, o: o[i], grads, out)
    return part(0), part(1), part(2), norm
