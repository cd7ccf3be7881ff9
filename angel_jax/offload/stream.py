"""The streamed optimizer update of ZeRO-Cache: state visits the device one chunk at a time.

Masters and optimizer state live in pinned host memory. A stacked layer weight (leading
"layers" axis) is updated in a scan over layers: each iteration copies one layer's masters and
state to the device, updates them, and copies them back, so the device holds about one layer's
worth of optimizer state instead of all of it. Other weights are one chunk each.
"""

import jax

from angel_jax.optim import Optimizer

Space = jax.memory.Space  # Memory spaces inside jit: Device and Host (pinned).


def _to(space, tree):
    return jax.tree.map(lambda x: jax.device_put(x, space), tree)


def streamed_update(optimizer: Optimizer, grads, state, masters, stacked, compute_dtype):
    """Updates host-resident `masters` and `state` with device-resident `grads`.

    `stacked` is a tree like the params of bools: which weights are stacked over layers.
    Returns (masters, state) as host-memory values, the new masters in `compute_dtype` on the
    device, and the global grad norm.
    """
    grads, norm = optimizer.clip(grads)

    def one(path, grad, leaf_state, master, is_stacked):
        if is_stacked:
            return _update_by_layer(optimizer, path, grad, leaf_state, master, compute_dtype)
        new_master, new_state = optimizer.update_leaf(
            path, grad, _to(Space.Device, leaf_state), jax.device_put(master, Space.Device)
        )
        return (
            jax.device_put(new_master, Space.Host),
            _to(Space.Host, new_state),
            new_master.astype(compute_dtype),
        )

    out = jax.tree_util.tree_map_with_path(one, grads, state, masters, stacked)
    part = lambda i: jax.tree.map(lambda _, o: o[i], grads, out)
    return part(0), part(1), part(2), norm


def _update_by_layer(optimizer, path, grad, leaf_state, master, compute_dtype):
    flat, treedef = jax.tree.flatten(leaf_state)
    per_layer = [x.ndim == master.ndim for x in flat]  # Moments: stacked like the weight.
    scalars = _to(Space.Device, [x for x, s in zip(flat, per_layer, strict=True) if not s])

    def rebuild(layer_parts, scalar_parts):
        layer_parts, scalar_parts = iter(layer_parts), iter(scalar_parts)
        return treedef.unflatten(
            [next(layer_parts) if s else next(scalar_parts) for s in per_layer]
        )

    def body(_, xs):
        grad_i, master_i, layer_parts = xs
        master_i = jax.device_put(master_i, Space.Device)
        layer_state = rebuild(_to(Space.Device, layer_parts), scalars)
        new_master, new_state = optimizer.update_leaf(path, grad_i, layer_state, master_i)
        new_flat = jax.tree.leaves(new_state)
        new_layer = [x for x, s in zip(new_flat, per_layer, strict=True) if s]
        new_scalars = [x for x, s in zip(new_flat, per_layer, strict=True) if not s]
        ys = (
            jax.device_put(new_master, Space.Host),
            _to(Space.Host, new_layer),
            new_master.astype(compute_dtype),
        )
        return new_scalars, ys

    layer_state = [x for x, s in zip(flat, per_layer, strict=True) if s]
    new_scalars, (new_master, new_layer, compute) = jax.lax.scan(
        body, scalars, (grad, master, layer_state)
    )
    return new_master, rebuild(new_layer, _to(Space.Host, new_scalars)), compute
