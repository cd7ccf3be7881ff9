"""The streamed optimizer update of ZeRO-Cache: state visits the device one chunk at a time.

Masters and optimizer state live in pinned host memory (or on disk, or on the device where it
has room), with each stacked layer weight (leading "layers" axis) kept as one array per layer:
a chunk is one array, fetched to the device, updated, and sent back on its own. Grads may be on
the device or, under layer streaming, in host memory: both are read a chunk (a layer) at a time.
Inside the jitted step, `pipelined` bounds how many chunks a pass over them (the grad norm,
host grad sums) holds on the device.
"""

import concurrent.futures as futures
import functools
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from angel_jax.offload.planner import CPU, DEVICE, HOST, SSD
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


class Chunk(NamedTuple):
    """One update chunk: an unstacked weight, or one layer's slice of a stacked weight, with its
    master and optimizer state."""

    key: str  # The weight's key path and layer: the SSD tier's file key.
    path: tuple  # The weight's key path in the params tree.
    weight: int  # The weight's index among the params' leaves.
    layer: int | None  # The layer of a stacked weight, None for an unstacked one.
    tier: str  # Where master and state live between steps: DEVICE, HOST or SSD.
    master: jax.ShapeDtypeStruct  # With its sharding on the device, where the update runs.
    state: object  # The chunk's optimizer state, of ShapeDtypeStructs likewise.

    @property
    def master_sharding(self):
        return self.master.sharding

    @property
    def state_sharding(self):
        return jax.tree.map(lambda x: x.sharding, self.state)


def home_kind(tier: str, leaf) -> str:
    """The memory kind a chunk's leaf lives in between steps, for a chunk on DEVICE or HOST:
    scalars (step counts) stay on the device, where moving them would cost more than keeping
    them."""
    return DEVICE if tier == DEVICE or leaf.ndim == 0 else HOST


class StreamedUpdate:
    """The ZeRO-Cache optimizer update, run after the jitted forward/backward step: each chunk's
    master and state are copied to the device, updated there, and copied back to their tier
    (read from and written to disk for the SSD tier); its new compute copy goes straight into
    the stacked compute buffer (donated, on the device or in host memory).

    The copies are runtime transfers, not copies inside one program: XLA runs one program's
    host->device and device->host copies one after the other (on the H200 the in-jit update
    took the sum of both directions' copy times), while the runtime uses one stream for each
    direction. Chunk k + `in_flight` // 2 is fetched while
    chunk k is updated, once chunk k + `in_flight` // 2 - `in_flight` is home, so the device
    holds at most `in_flight` chunks (plus their outputs being copied back).

    The runtime starts a copy only after the device work queued before it, and runs it beside
    the work queued after it (`copy_overlap_probe.json`, H200: 8 GiB down queued before a
    165 ms program took 167 ms in all, queued after it 319). So the first `in_flight` // 2
    chunks are fetched by `prefetch` before the forward/backward that makes their grads is
    dispatched, and the last chunks' copies home run beside the next one.
    """

    def __init__(
        self, optimizer: Optimizer, chunks: list[Chunk], in_flight: int, ssd=None, cpu=None
    ):
        self.optimizer, self.in_flight, self.ssd, self.cpu = optimizer, in_flight, ssd, cpu
        self.chunks = [c for c in chunks if c.tier != CPU]  # The device updates these.
        self.ahead = max(1, in_flight // 2)
        self.most_in_flight = 0  # The most chunks on the device at once, as scheduled.
        self._fns = {}
        # Per chunk, its leaves [master, *state] flat: the ones to move between tiers, with
        # their shardings on the device and at home. Built once: the loop is Python-bound
        # on small chunks.
        self._moves = []
        for c in self.chunks:
            leaves = [c.master, *jax.tree.leaves(c.state)]
            moved = [
                i for i, x in enumerate(leaves) if c.tier == SSD or home_kind(c.tier, x) != DEVICE
            ]
            on_device = [leaves[i].sharding for i in moved]
            home = [x.with_memory_kind(HOST) for x in on_device]
            self._moves.append((jax.tree.structure(c.state), moved, on_device, home))

    def prefetch(self, masters: list, states: list) -> dict:
        """Starts the first `in_flight` // 2 chunks' copies to the device (arguments as
        `__call__`'s), for `__call__`'s `fetched`: call it before dispatching the step whose
        grads the update takes, so the copies run beside that step. The host copies stay until
        the update reads them: an update left out (an anomalous step) loses nothing."""
        first = range(min(self.ahead, len(self.chunks)))
        return {k: self._fetch(k, masters, states) for k in first}

    def _leaves(self, k: int, masters: list, states: list) -> list:
        """Chunk k's [master, *state leaves] as they are between steps."""
        c = self.chunks[k]
        get = lambda tree: tree[c.weight] if c.layer is None else tree[c.weight][c.layer]
        return [get(masters), *jax.tree.leaves(get(states))]

    def _move(self, k: int, leaves: list, to_device: bool) -> list:
        """Chunk k's leaves with the moving ones copied to the device or home."""
        _, moved, on_device, home = self._moves[k]
        copies = jax.device_put([leaves[i] for i in moved], on_device if to_device else home)
        leaves = list(leaves)
        for i, x in zip(moved, copies, strict=True):
            leaves[i] = x
        return leaves

    def _fetch(self, k: int, masters: list, states: list):
        """Chunk k on its way to the device: its leaves, or for the SSD tier futures of
        (master, state) read on the SSD's threads."""
        if self.chunks[k].tier == SSD:
            return self.ssd.read(self.chunks[k])
        return self._move(k, self._leaves(k, masters, states), to_device=True)

    def __call__(
        self,
        grads: list,
        scale,
        masters: list,
        states: list,
        compute: list,
        on_cpu=None,
        fetched=None,
    ):
        """Updates every chunk with its grad times `scale` (the clipping factor).

        Arguments are flat lists over the params' leaves: `grads` and `compute` stacked for
        stacked weights (grads may instead be tuples of layers), `masters` and `states` tuples
        of layers for stacked weights, with None for chunks on the SSD tier; `on_cpu`: the
        host's share as `start_on_cpu` returned it, if started already; `fetched`: what
        `prefetch` returned for these masters and states. Returns the new (masters, states,
        compute) likewise; donates `masters`, `states` and `compute`.
        """
        chunks, n = self.chunks, len(self.chunks)
        # The host's cores start on theirs (hybrid update) while the device works on its own.
        if on_cpu is None:
            on_cpu = self.start_on_cpu(grads, scale, compute)
        fetched = dict(fetched or self.prefetch(masters, states))
        stacked = {c.weight for c in chunks if c.layer is not None}
        masters, states = (
            [list(x) if w in stacked else x for w, x in enumerate(tree)]
            for tree in (masters, states)
        )
        compute = list(compute)

        def put(tree, c, value):
            if c.layer is None:
                tree[c.weight] = value
            else:
                tree[c.weight][c.layer] = value

        def release(k):
            """Deletes chunk k's host copies once its copies down are queued (the caller's
            state is donated): else the old and the new states would both be in host memory
            until the update returns. Freed once the copies have read them."""
            if chunks[k].tier != SSD:
                leaves = self._leaves(k, masters, states)
                for i in self._moves[k][1]:
                    leaves[i].delete()

        home = []  # Per chunk: what to wait on before its device buffers are free.
        gone = 0  # Chunks waited for (home, their device buffers free).
        for k, c in enumerate(chunks):
            state_def = self._moves[k][0]
            if c.tier == SSD:
                master, state = (f.result() for f in fetched.pop(k))
                leaves = self._move(k, [master, *jax.tree.leaves(state)], to_device=True)
            else:
                leaves = fetched.pop(k)
                release(k)
            grad = grads[c.weight]
            if isinstance(grad, tuple):
                grad = grad[c.layer]
            master, state, compute[c.weight] = self._fn(c, grad, compute[c.weight])(
                grad,
                layer_index(c.master_sharding.mesh, c.layer or 0),
                scale,
                leaves[0],
                state_def.unflatten(leaves[1:]),
                compute[c.weight],
            )
            if c.tier == SSD:
                home.append(self.ssd.put(c, master, state))
            else:
                leaves = self._move(k, [master, *jax.tree.leaves(state)], to_device=False)
                put(masters, c, leaves[0])
                put(states, c, state_def.unflatten(leaves[1:]))
                home.append(leaves)
            nxt = k + self.ahead
            if nxt < n:
                if nxt - self.in_flight >= 0:
                    _wait(home[nxt - self.in_flight])
                    home[nxt - self.in_flight] = None
                    gone += 1
                fetched[nxt] = self._fetch(nxt, masters, states)
            # Fetched and not yet updated, or updated and maybe not yet home.
            on_device = len(fetched) + len(home) - gone
            self.most_in_flight = max(self.most_in_flight, on_device)
        start = time.perf_counter()
        for c, new in on_cpu:
            compute[c.weight] = _into_compute(compute[c.weight], new.result(), c.layer)
        if self.cpu:  # Waited for the host's cores, and copying their weights up.
            self.cpu.seconds["waited after the device's chunks"] += time.perf_counter() - start
        tuples = lambda tree: [tuple(x) if w in stacked else x for w, x in enumerate(tree)]
        return tuples(masters), tuples(states), compute

    def start_on_cpu(self, grads: list, scale, compute: list) -> list:
        """Starts the host cores' share (`cpu.CPUTier.update`; arguments as `__call__`'s)."""
        return self.cpu.update(grads, scale, compute) if self.cpu else []

    def _fn(self, c: Chunk, grad, compute):
        """The jitted update of one chunk: one program per weight, not per layer."""
        indexed = grad.ndim > c.master.ndim  # A stacked grad: the program picks the layer.
        key = (c.weight, indexed)
        if key not in self._fns:

            def update(grad, layer, scale, master, state, compute):
                if indexed:
                    grad = jax.lax.dynamic_index_in_dim(grad, layer, keepdims=False)
                master, state = self.optimizer.update_leaf(
                    c.path, fetch_f32(grad) * scale, state, master
                )
                new = master.astype(compute.dtype)
                if c.layer is not None:
                    new = jax.device_put(new, jax.typeof(compute).memory_space)
                    new = jax.lax.dynamic_update_index_in_dim(compute, new, layer, 0)
                return master, state, new

            self._fns[key] = jax.jit(
                update,
                out_shardings=(c.master_sharding, c.state_sharding, compute.sharding),
                donate_argnums=(3, 4, 5),  # The compute copy is updated in place.
            )
        return self._fns[key]


def _into_compute(compute: jax.Array, new: jax.Array, layer: int | None) -> jax.Array:
    """The compute copy with `new` (a weight, or a layer of a stacked one, in pinned host
    memory) in its place; a stacked copy is updated in place (donated)."""
    if layer is None:
        out = jax.device_put(new, compute.sharding)
        compute.delete()
        return out
    index = layer_index(compute.sharding.mesh, layer)
    return _set_layer(compute.sharding)(compute, new, index)


@functools.cache
def layer_index(mesh, layer: int) -> jax.Array:
    """A layer as a replicated device scalar, made once (no host->device copy per step)."""
    return jax.device_put(np.int32(layer), NamedSharding(mesh, P()))


@functools.cache
def _set_layer(sharding):
    def set_layer(stacked, new, layer):
        new = jax.device_put(new, jax.typeof(stacked).memory_space)
        return jax.lax.dynamic_update_index_in_dim(stacked, new, layer, 0)

    return jax.jit(set_layer, out_shardings=sharding, donate_argnums=0)


def _wait(pending) -> None:
    """Blocks until a chunk is home: its arrays ready, or its SSD writes done."""
    for x in jax.tree.leaves(pending):
        if isinstance(x, futures.Future):
            x.result()
        else:
            x.block_until_ready()
