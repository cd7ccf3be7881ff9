"""The offloaded state's bookkeeping (ZeRO-Cache): its layout, its initialisation, and the
conversions to and from what checkpoints hold.

Offloaded masters and optimizer state keep each stacked weight as one array per layer, in
pinned host memory or on the device (`host_layout`), with the chunks of the tiers that hold
their own (the SSD tier, the host's cores' tier of the hybrid update) absent (None);
the compute copy on the device (or, under layer streaming, in host memory) is derived from the
masters, or with split masters (`Plan.split_masters`, `masters.py`) is their high halves while
their tiers keep the low ones. `OffloadedState` builds that state and converts it: checkpoints
hold those tiers' chunks, and leave the compute copy out unless it holds the high halves.
"""

import collections
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from angel_jax.offload.cpu import CPUTier
from angel_jax.offload.masters import LOW, compute_copy, join_numpy, split, split_numpy
from angel_jax.offload.moves import home_kind
from angel_jax.offload.ssd import SSDTier
from angel_jax.offload.stream import Chunk, unstack, unstack_like
from angel_jax.optim import Optimizer
from angel_jax.planning.plan import Plan
from angel_jax.planning.tiers import CPU, DEVICE, SSD
from angel_jax.sharding import with_shardings


def host_layout(abstract_params, abstract_opt, master_sharding, opt_sharding, stacked, plan: Plan):
    """Shapes and shardings of masters and optimizer state in the streamed update's layout:
    stacked weights split into one array per layer, each sharded like a layer slice of its
    (ZeRO) layout, in pinned host memory (or on the device, for chunks the plan keeps there).
    Chunks on the SSD or CPU tier are None there. A split master (`plan.split_masters`) is its
    low half (`masters.LOW`), but the host cores' chunks'. Also returns every update chunk, in
    update order (with its shardings on the device)."""
    host_params = jax.eval_shape(lambda p: unstack(p, stacked), abstract_params)
    host_opt = jax.eval_shape(lambda s: unstack_like(s, stacked, abstract_params), abstract_opt)
    if plan.split_masters:  # Their tiers keep the low halves, but the host cores' chunks.

        def low_half(path, is_stacked, x):
            key = jax.tree_util.keystr(path)
            low = lambda x, layer: (
                x if plan.chunk_tier(key, layer) == CPU else jax.ShapeDtypeStruct(x.shape, LOW)
            )
            return tuple(low(y, i) for i, y in enumerate(x)) if is_stacked else low(x, None)

        host_params = jax.tree_util.tree_map_with_path(low_half, stacked, host_params)

    def on_host(path, is_stacked, shardings, abstract):
        def one(s, x, layer=None):
            spec = P(*s.spec[1:]) if is_stacked else s.spec
            tier = plan.chunk_tier(jax.tree_util.keystr(path), layer)
            kind = DEVICE if tier in OUTSIDE else home_kind(tier, x)
            return NamedSharding(s.mesh, spec, memory_kind=kind)

        if not is_stacked:
            return jax.tree.map(one, shardings, abstract)
        return tuple(
            jax.tree.map(lambda s, x, i=i: one(s, x, i), shardings, abstract[i])
            for i in range(len(abstract))
        )

    masters = jax.tree_util.tree_map_with_path(on_host, stacked, master_sharding, host_params)
    opt = jax.tree_util.tree_map_with_path(on_host, stacked, opt_sharding, host_opt)
    chunks = []
    treedef = jax.tree.structure(stacked)
    trees = (with_shardings(host_params, masters), with_shardings(host_opt, opt))
    flat = [treedef.flatten_up_to(t) for t in trees]
    for w, ((path, is_stacked), m, o) in enumerate(
        zip(jax.tree_util.tree_leaves_with_path(stacked), *flat, strict=True)
    ):
        key = jax.tree_util.keystr(path)
        for layer in range(len(m)) if is_stacked else [None]:
            pick = (lambda x: x) if layer is None else (lambda x, i=layer: x[i])
            tier = plan.chunk_tier(key, layer)
            chunks.append(
                Chunk(
                    f"{key}[{layer}]",
                    path,
                    w,
                    layer,
                    tier,
                    *map(_abstract_on_device, (pick(m), pick(o))),
                )
            )

    def drop(tree):
        def one(path, is_stacked, sub):
            key = jax.tree_util.keystr(path)
            if not is_stacked:
                return None if plan.chunk_tier(key, None) in OUTSIDE else sub
            return tuple(
                None if plan.chunk_tier(key, i) in OUTSIDE else x for i, x in enumerate(sub)
            )

        return jax.tree_util.tree_map_with_path(one, stacked, tree)

    return drop(host_params), drop(host_opt), drop(masters), drop(opt), chunks


OUTSIDE = (SSD, CPU)  # The tiers that hold their chunks themselves, not in the state tree.


class Outside:
    """The tiers that hold their chunks outside the state tree (SSD, CPU) as one: their
    chunks in order, each read and written through its own tier, and moved between those
    tiers and the places (None) they leave in the state tree, which checkpoints fill."""

    def __init__(self, stacked, split_masters: bool, *tiers):
        self.tiers = [t for t in tiers if t]
        self.chunks = [c for t in self.tiers for c in t.chunks]
        self.by_key = {k: c for t in self.tiers for k, c in t.by_key.items()}
        self._tier = {c.key: t for t in self.tiers for c in t.chunks}
        self._treedef = jax.tree.structure(stacked)
        # Checkpoints then hold every master as its low half, the host cores' too.
        self.split_masters = split_masters

    def __bool__(self) -> bool:
        return bool(self.chunks)

    def put(self, chunk, master, state):
        return self._tier[chunk.key].put(chunk, master, state)

    def read_all(self) -> list:
        return [v for t in self.tiers for v in t.read_all()]

    def wait(self) -> None:
        for t in self.tiers:
            t.wait()

    def fill(self, tree, values: list):
        """A masters- or optimizer-state-shaped `tree` (per layer) with each chunk's None
        replaced by its item of `values` (one per chunk, in order)."""
        flat = self._treedef.flatten_up_to(tree)
        for chunk, value in zip(self.chunks, values, strict=True):
            if chunk.layer is None:
                flat[chunk.weight] = value
            else:
                layers = list(flat[chunk.weight])
                layers[chunk.layer] = value
                flat[chunk.weight] = tuple(layers)
        return self._treedef.unflatten(flat)

    def take(self, tree):
        """(`tree` with None where the chunks are, their values in chunk order)."""
        flat = self._treedef.flatten_up_to(tree)
        values = []
        for chunk in self.chunks:
            if chunk.layer is None:
                values.append(flat[chunk.weight])
                flat[chunk.weight] = None
            else:
                layers = list(flat[chunk.weight])
                values.append(layers[chunk.layer])
                layers[chunk.layer] = None
                flat[chunk.weight] = tuple(layers)
        return self._treedef.unflatten(flat), values

    def filled(self, shardings, field: str):
        """Masters' or optimizer state's `shardings` with the chunks' device shardings (their
        `field`) where the state holds None."""
        if not self:
            return shardings
        return self.fill(shardings, [getattr(c, field) for c in self.chunks])

    def checkpointed(self, state):
        """`state` with the chunks read in as numpy arrays, every split master as its low half."""
        values = self.read_all()
        masters = [
            split_numpy(m) if self.split_masters and c.tier == CPU else m
            for c, (m, _) in zip(self.chunks, values, strict=True)
        ]
        return state.replace(
            params=self.fill(state.params, masters),
            opt_state=self.fill(state.opt_state, [s for _, s in values]),
        )

    def checkpoint_target(self, state):
        """The abstract `state` with the chunks in as `checkpointed` gives them: empty numpy."""
        empty = lambda tree: jax.tree.map(lambda x: np.empty(x.shape, x.dtype), tree)
        low = lambda c: np.empty(c.master.shape, LOW) if self.split_masters else empty(c.master)
        return state.replace(
            params=self.fill(state.params, [low(c) for c in self.chunks]),
            opt_state=self.fill(state.opt_state, [empty(c.state) for c in self.chunks]),
        )

    def restore(self, state):
        """`state` without the chunks, which go back in their tiers (on disk, in the CPU tier),
        the host cores' split masters joined whole with their compute copy's high halves."""
        masters, master_values = self.take(state.params)
        opt, state_values = self.take(state.opt_state)
        computes = self._treedef.flatten_up_to(state.compute_params)
        compute = functools.cache(lambda w: np.asarray(jax.device_get(computes[w])))
        for chunk, m, s in zip(self.chunks, master_values, state_values, strict=True):
            if self.split_masters and chunk.tier == CPU:  # The host cores' go whole.
                high = compute(chunk.weight)
                m = join_numpy(m, high if chunk.layer is None else high[chunk.layer])
            self.put(chunk, m, s)
        self.wait()
        return state.replace(params=masters, opt_state=opt)


def _abstract_on_device(abstract_tree):
    """The same shapes with their shardings moved to device memory."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=x.sharding.with_memory_kind(DEVICE)
        ),
        abstract_tree,
    )


def _stacked_sharding(is_stacked, host_shardings):
    """The device sharding of a whole weight from its (per-layer, pinned-host) shardings."""
    one = host_shardings[0] if is_stacked else host_shardings
    spec = P(None, *one.spec) if is_stacked else one.spec
    return NamedSharding(one.mesh, spec, memory_kind="device")


@dataclasses.dataclass(frozen=True)
class OffloadedState:
    """What the offloaded states' bookkeeping needs: their layout and the SSD tier. `init`
    gives a `state_layout.TrainState`'s fields; the other methods take and give `TrainState`s
    (changed through `.replace`)."""

    stacked: Any  # Like the params, of bools: stacked over layers (a leading "layers" axis).
    optimizer: Optimizer
    state_sharding: Any  # A TrainState of NamedShardings, in the host layout.
    dtype: jnp.dtype  # Of the compute copy.
    ssd: SSDTier | None = None  # Update chunks on disk (ZeRO-Cache's third tier), if any.
    cpu: CPUTier | None = None  # Update chunks the host's cores update, if any.
    # The masters' tiers hold their low halves, the compute copy their high halves
    # (`Plan.split_masters`); the host cores' chunks keep theirs whole.
    split_masters: bool = False

    @functools.cached_property
    def outside(self) -> Outside:
        return Outside(self.stacked, self.split_masters, self.ssd, self.cpu)

    def init(self, init_params, rng) -> tuple:
        """(step, params, opt_state, compute_params) of a fresh state, with the params from
        `init_params(rng)` (in the model's layout).

        Builds the offloaded state a weight, and for a stacked weight a layer, at a time:
        the device holds the fp32 params, the compute copy made so far and one layer's
        optimizer state on its way out, never a whole weight's; SSD chunks are written with at
        most two layers' writes pending, so neither memory holds the disk's share (building a
        whole weight's state at once and queueing every SSD write took the 15B model to 126 GiB
        on the device and 159 GiB of host memory, against a plan of 104 and 85)."""
        return _LayerwiseInit(self).build(init_params, rng)

    def params_numpy(self, state):
        """The fp32 masters of `state` as numpy arrays in the model's layout: the chunks held
        outside read in, split ones joined with the compute copy, each stacked weight's layers
        stacked again."""
        params = jax.device_get(state.params)
        if self.outside:  # Fill in the chunks held outside.
            params = self.outside.fill(params, [m for m, _ in self.outside.read_all()])
        if self.split_masters:
            whole = lambda low, compute: low if low.dtype != LOW else join_numpy(low, compute)
            params = jax.tree.map(
                lambda is_stacked, m, c: tuple(map(whole, m, c)) if is_stacked else whole(m, c),
                self.stacked,
                params,
                jax.device_get(state.compute_params),
            )
        return jax.tree.map(lambda s, p: np.stack(p) if s else p, self.stacked, params)

    def checkpointed(self, state):
        """What checkpoints hold: the compute copy left out where it is derived (kept where
        it holds the split masters' high halves), the SSD and CPU tiers' chunks in (as numpy
        arrays: the SSD tier passes through host memory while saving). With split masters
        every master is its low half there, the host cores' too (their compute copy is their
        high half as well): a run that places its chunks in other tiers restores it."""
        if not self.split_masters:
            state = state.replace(compute_params=None)
        return self.outside.checkpointed(state) if self.outside else state

    def checkpoint_target(self, abstract_state):
        """The abstract `checkpointed` state to restore into: the chunks held outside as
        numpy."""
        state = abstract_state
        if not self.split_masters:
            state = state.replace(compute_params=None)
        return self.outside.checkpoint_target(state) if self.outside else state

    def from_checkpointed(self, state):
        """Re-derives what `checkpointed` left out, and puts the chunks held outside back in
        their tiers (on disk, in the CPU tier)."""
        if not self.split_masters:
            derive = jax.jit(self._compute_params, out_shardings=self.state_sharding.compute_params)
            state = state.replace(compute_params=derive(state.params))
        return self.outside.restore(state) if self.outside else state

    def _compute(self, master):
        """The compute copy of a float32 master, as the update makes it (`stream.compute_copy`)."""
        return compute_copy(master, master.dtype, self.dtype)[1]

    def _compute_params(self, masters):
        """The compute copy of whole `masters` (the chunks held outside filled in), a stacked
        weight's layers stacked again; inside jit."""
        shardings = self.outside.filled(self.state_sharding.params, "master_sharding")
        on_device = jax.tree.map(lambda s: s.with_memory_kind("device"), shardings)
        masters = jax.device_put(masters, on_device)
        return jax.tree.map(
            lambda is_stacked, m: (
                jnp.stack([self._compute(x) for x in m]) if is_stacked else self._compute(m)
            ),
            self.stacked,
            masters,
        )


class _LayerwiseInit:
    """Builds `OffloadedState.init`'s fresh state a weight, and a stacked weight a layer, at a
    time, with at most two layers' SSD writes pending (that method says why)."""

    def __init__(self, offloaded: OffloadedState):
        self.offloaded = offloaded
        self.outside = offloaded.outside
        self.pending = collections.deque()  # SSD writes not known to be done, a pair per layer.
        self.low_half = jax.jit(lambda m: split(m, offloaded.dtype)[0])

    def build(self, init_params, rng) -> tuple:
        """(step, params, opt_state, compute_params), with the params from `init_params(rng)`."""
        offloaded = self.offloaded
        state_sharding = offloaded.state_sharding
        master_shardings = self.outside.filled(state_sharding.params, "master_sharding")
        opt_shardings = self.outside.filled(state_sharding.opt_state, "state_sharding")
        # Same values as the on-device init gives; on the device in the offloaded masters' layout.
        master_layout = jax.tree.map(_stacked_sharding, offloaded.stacked, master_shardings)
        params = jax.jit(init_params, out_shardings=master_layout)(rng)
        flat = jax.tree_util.tree_map_with_path(
            self.weight,
            params,
            offloaded.stacked,
            master_shardings,
            opt_shardings,
            state_sharding.compute_params,
        )
        part = lambda i: jax.tree.map(lambda _, o: o[i], params, flat)
        if self.outside:
            self.outside.wait()
        # The step as the jitted step returns it, so its first call compiles what later use.
        step = jax.device_put(jnp.zeros((), jnp.int32), state_sharding.step)
        return step, part(0), part(1), part(2)

    def weight(self, path, param, is_stacked, master_sharding, opt_sharding, compute_sharding):
        """(master, state, compute) of one weight, placed where they stay; frees `param`."""
        key, init = jax.tree_util.keystr(path), self.offloaded.optimizer.init_leaf
        compute = jax.jit(self.offloaded._compute, out_shardings=compute_sharding)(param)
        if is_stacked:
            one_layer = jax.jit(
                lambda p, i: (
                    x := jax.lax.dynamic_index_in_dim(p, i, keepdims=False),
                    init(path, x),
                )
            )
            layers = [
                self.place(key, i, *one_layer(param, i), (master_sharding[i], opt_sharding[i]))
                for i in range(param.shape[0])
            ]
            master, state = tuple(m for m, _ in layers), tuple(s for _, s in layers)
        else:
            master, state = jax.jit(lambda p: (p, init(path, p)))(param)
            master, state = self.place(key, None, master, state, (master_sharding, opt_sharding))
        param.delete()  # Free the device copy now, not when the whole tree is done.
        return master, state, compute

    def place(self, key, layer, master, state, shardings):
        """(master, state), made on the device, where they stay (`shardings`): None, None
        for a chunk that went to disk or to the host's cores. Split masters keep their low
        halves there, but the host cores' chunks."""
        chunk = self.outside.by_key.get((key, layer)) if self.outside else None
        if self.offloaded.split_masters and not (chunk and chunk.tier == CPU):
            master = self.low_half(master)
        master, state = jax.device_put((master, state), shardings)
        if chunk is None:
            return master, state
        self.pending.append(self.outside.put(chunk, master, state))
        while len(self.pending) > 2:
            for write in self.pending.popleft():
                write.result()
        return None, None
