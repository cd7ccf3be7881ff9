"""The streamed optimizer update of ZeRO-Cache: state visits the device one chunk at a time.

Masters and optimizer state live in pinned host memory, with each stacked layer weight (leading
"layers" axis) kept as one array per layer: a chunk is one array, so the update can read it,
write its successor into the same donated host buffer, and let XLA overlap one chunk's copies
with another's update. The device holds a few chunks at a time instead of the whole state.
Grads may be on the device or, under layer streaming, in host memory: both are read a chunk
(a layer) at a time.
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


def to_space(space, tree):
    return jax.tree.map(lambda x: jax.device_put(x, space), tree)


def fetch_f32(grad):
    """A grad chunk on the device in float32, wherever it was."""
    return jax.device_put(grad, Space.Device).astype(jnp.float32)


def pipelined(fn, chunks, in_flight: int) -> list:
    """[fn(k, *chunk) for k, chunk in enumerate(chunks)], with at most `in_flight` chunks (tuples
    of arrays) on the device at once.

    Chunk k's inputs wait (an optimization barrier) until chunk k - in_flight's last output
    exists, else XLA's scheduler would start every host->device copy early and hold all of
    them on the device. `fn` returns a tuple whose last item is a device value.
    """
    done = []
    for k, chunk in enumerate(chunks):
        if k >= in_flight:
            *chunk, _ = jax.lax.optimization_barrier((*chunk, done[k - in_flight][-1]))
        done.append(fn(k, *chunk))
    return done


def layer_chunks(grads, *trees, stacked):
    """Flattens params-shaped trees into chunks (path, grad, *tree leaves), a stacked weight's
    layers as separate chunks (its leaves may be stacked arrays or per-layer tuples); also
    returns each weight's layer count (None if unstacked) and the params' treedef."""
    paths_flags, treedef = jax.tree_util.tree_flatten_with_path(stacked)
    leaves = [treedef.flatten_up_to(t) for t in (grads, *trees)]
    chunks, layers = [], []
    for (path, is_stacked), *parts in zip(paths_flags, *leaves, strict=True):
        if is_stacked:
            n = len(parts[0])
            chunks += [(path, *(p[i] for p in parts)) for i in range(n)]
            layers.append(n)
        else:
            chunks.append((path, *parts))
            layers.append(None)
    return chunks, layers, treedef


def regroup(done, layers, treedef):
    """Inverse of `layer_chunks` for per-chunk outputs: one tree per output position, a stacked
    weight's layers as a tuple."""
    outs, k = [], 0
    for n in layers:
        if n is None:
            outs.append(done[k])
            k += 1
        else:
            outs.append(tuple(zip(*done[k : k + n], strict=True)))
            k += n
    return [treedef.unflatten([o[i] for o in outs]) for i in range(len(done[0]))]


def global_norm(grads, stacked, in_flight: int):
    """The global grad norm, one chunk at a time (grads may be in host memory)."""
    chunks, _, _ = layer_chunks(grads, stacked=stacked)
    squares = pipelined(
        lambda _, g: (jnp.sum(jnp.square(fetch_f32(g))),), [(g,) for _, g in chunks], in_flight
    )
    return jnp.sqrt(sum(s for (s,) in squares))


def streamed_update(
    optimizer: Optimizer,
    grads,
    state,
    masters,
    compute,
    stacked,
    in_flight: int = 2,
):
    """Updates unstacked `masters` and `state` (each chunk in pinned host memory or on the
    device) with `grads`. Chunks on the SSD tier (None in `masters`) are left to
    `SSDTier.update`: their grads come back in a list, with the clipping scale.

    Returns (masters, state) in the same memories and layout; the new compute copy, in
    `compute`'s buffers (stacked weights on the device, or in host memory under layer
    streaming; SSD chunks' layers keep their old values); the global grad norm before
    clipping; and (the SSD chunks' grads, the clipping scale).
    """
    norm = global_norm(grads, stacked, in_flight)
    scale = optimizer.clip_scale(norm)
    chunks, layers, treedef = layer_chunks(grads, state, masters, stacked=stacked)
    owner = [(w, i) for w, n in enumerate(layers) for i in (range(n) if n else [None])]
    new_compute = treedef.flatten_up_to(compute)
    ssd_grads = []

    def update(k, grad, chunk_state, master):
        if master is None:  # On the SSD tier.
            ssd_grads.append(grad)
            return None, None, grad
        new_master, new_state = optimizer.update_leaf(
            chunks[k][0],
            fetch_f32(grad) * scale,
            to_space(Space.Device, chunk_state),
            jax.device_put(master, Space.Device),
        )
        # Each layer's new compute copy goes straight into the (donated) stacked buffer,
        # wherever it lives: stacking them all first would hold a second copy on the device.
        w, layer = owner[k]
        buffer = new_compute[w]
        cast = new_master.astype(buffer.dtype)
        if layer is None:
            new_compute[w] = cast
        else:
            layer_copy = jax.device_put(cast, jax.typeof(buffer).memory_space)
            new_compute[w] = jax.lax.dynamic_update_index_in_dim(buffer, layer_copy, layer, 0)
        # Back to the chunk's tier: host memory, or the device for chunks the plan keeps there.
        tier = jax.typeof(master).memory_space
        return jax.device_put(new_master, tier), to_space(tier, new_state), cast

    done = pipelined(update, [chunk[1:] for chunk in chunks], in_flight)
    new_masters, new_state, _ = regroup(done, layers, treedef)
    return new_masters, new_state, treedef.unflatten(new_compute), norm, (ssd_grads, scale)
