"""The streamed optimizer update of ZeRO-Cache: state visits the device one chunk at a time.

Masters and optimizer state live in pinned host memory (or on disk, or on the device where it
has room), with each stacked layer weight (leading "layers" axis) kept as one array per layer:
a chunk is one array, fetched to the device, updated, and sent back on its own. Grads may be on
the device or, under layer streaming, in host memory: both are read a chunk (a layer) at a time.
Inside the jitted step, `pipelined` bounds how many chunks a pass over them (the grad norm,
host grad sums) holds on the device.
"""

import collections
import dataclasses
import functools
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from angel_jax import dispatch
from angel_jax.offload import moves
from angel_jax.offload.masters import LOW, compute_copy, join
from angel_jax.offload.moves import Homebound, Moves
from angel_jax.offload.programs import GroupPrograms, Space, fetch_f32
from angel_jax.optim import Optimizer
from angel_jax.planning.groups import chunk_part, flight, group_chunks, slot_order
from angel_jax.planning.plan import local_bytes
from angel_jax.planning.tiers import CPU, DEVICE, SSD


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


def pipelined(fn, chunks, in_flight: int) -> list:
    """[fn(k, *chunk) for k, chunk in enumerate(chunks)], with at most `in_flight` chunks (tuples
    of arrays) on the device at once.

    Chunk k's inputs wait (an optimization barrier) until chunk k - in_flight's last output
    exists, else XLA's scheduler would start every host->device copy early and hold all of
    them on the device. `fn` returns a tuple whose last item is what the chunk `in_flight`
    later waits for (arrays on the device, or copies home).
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
    """The global grad norm, summed weight by weight: a weight on the device in one reduction,
    one in host memory a chunk (a layer) at a time, `in_flight` fetched at once (`pipelined`).
    (On the CPU, layer slices of a weight on the device through `pipelined`'s barriers were
    copied out first: 3.6 GiB of temporaries for llama_1b's float32 grads of 4.1 GB.)"""
    square = lambda g: jnp.sum(jnp.square(g.astype(jnp.float32)))
    on_device = lambda g: not isinstance(g, tuple) and jax.typeof(g).memory_space != Space.Host
    flat = jax.tree.structure(stacked).flatten_up_to(grads)
    weights = list(zip(flat, jax.tree.leaves(stacked), strict=True))
    layers = lambda g, is_stacked: [g[i] for i in range(len(g))] if is_stacked else [g]
    on_host = [c for g, s in weights if not on_device(g) for c in layers(g, s)]
    fetch = lambda _, g: (square(fetch_f32(g)),)
    fetched = iter(pipelined(fetch, [(c,) for c in on_host], in_flight))
    total = 0.0
    for g, is_stacked in weights:
        if on_device(g):
            total += square(g)
        else:
            total += sum(next(fetched)[0] for _ in layers(g, is_stacked))
    return jnp.sqrt(total)


def update_in_step(
    optimizer: Optimizer,
    chunks: list["Chunk"],
    order: list[int],
    grads: list,
    scale: jax.Array,
    masters: list,
    states: list,
    compute: list,
    in_flight: int,
    ok: jax.Array | None,
) -> tuple[list, list, list]:
    """The streamed update traced into the forward/backward's program
    (config.offload.update_in_step): each chunk's master and state fetched to the device,
    updated with its grad times `scale` and sent home, and its new compute copy made, in
    `order` (indices into `chunks`: the backward pass's) with at most `in_flight` chunks on
    the device at once: a chunk is fetched once the chunk `in_flight` before it is home
    (`pipelined`, on its copies home). With `ok` false (an anomalous step; None: never)
    every chunk keeps its old values. Chunks are unstacked weights on the device or in host
    memory; arguments and results are flat lists over the params' leaves, as
    `StreamedUpdate`'s."""
    assert all(c.layer is None for c in chunks), "the update in the step takes no stacked weights"
    masters, states, compute = list(masters), list(states), list(compute)

    def one(i, master, state, grad):
        c = chunks[order[i]]
        home = jax.tree.map(lambda x: jax.typeof(x).memory_space, (master, state))
        old = jax.tree.map(lambda x: jax.device_put(x, Space.Device), (master, state))
        master = join(old[0], compute[c.weight]) if old[0].dtype == LOW else old[0]
        new = optimizer.update_leaf(c.path, fetch_f32(grad) * scale, old[1], master)
        kept, new_compute = compute_copy(new[0], old[0].dtype, compute[c.weight].dtype)
        new = (kept, new[1])
        if ok is not None:
            new = jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)
            new_compute = jnp.where(ok, new_compute, compute[c.weight])
        # Last: the copies home, which the chunk in_flight after this one waits for.
        return new_compute, jax.tree.map(jax.device_put, new, home)

    inputs = [
        (masters[c.weight], states[c.weight], grads[c.weight])
        for c in map(chunks.__getitem__, order)
    ]
    for k, (new_compute, (master, state)) in zip(
        order, pipelined(one, inputs, in_flight), strict=True
    ):
        w = chunks[k].weight
        masters[w], states[w], compute[w] = master, state, new_compute
    return masters, states, compute


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


class Schedule(NamedTuple):
    """The streamed update's chunks, groups and groups in flight (`update_schedule`)."""

    chunks: list[Chunk]  # The chunks the device updates, in update order.
    groups: list[list[int]]  # Indices into `chunks`, a group's chunks updated together.
    group_bytes: list[int]  # Per group, its chunks' bytes (per device).
    moved_bytes: list[int]  # Per group, the bytes it moves (those not resident on the device).
    between_groups: int  # How many groups (the first) may run between microbatches.
    last_group: dict[int, int]  # Per weight (flat index), the last group that updates it.
    parts: list  # Per chunk, its part of its weight (`groups.chunk_part`).
    in_flight: int  # The most groups on the device at once, fetched or on their way home.
    ahead: int  # How many groups are fetched ahead of the one updated.
    leaving: int  # How many groups stay on their way home beside the next step.


def update_schedule(chunks: list[Chunk], in_flight: int, slot_bytes: int) -> Schedule:
    """The chunks the device updates (not the host cores', `cpu.CPUTier`'s), in order, their
    groups, and how many of these are in flight, all fixed by the plan.

    Consecutive chunks of one tier move and update together, as a group: one copy call each
    way and one program. Each chunk costs the host about 1.2 ms of runtime calls, the device
    idle between the update's tiny kernels meanwhile (250 ms a step for llama_1b's 201
    chunks). The planner makes the groups (`groups.group_chunks`, at most
    256 MiB each unless every chunk is in flight, a larger chunk alone), so its bounds are the
    update's own."""
    # Between microbatches (`Plan.slot_bytes`): a group a slot, one fetched while the
    # last one goes home (config.offload.chunks_in_flight does not apply).
    in_flight = 2 if slot_bytes else in_flight
    ahead, leaving = flight(in_flight)
    chunks = [c for c in chunks if c.tier != CPU]
    if slot_bytes:
        leaving = 1  # One left on its way home, beside the next step's first fetched.
        # Chunks larger than a slot last: they run after the last microbatch.
        tiers = [c.tier for c in chunks]
        order = slot_order([chunk_bytes(c) for c in chunks], tiers, slot_bytes)
        chunks = [chunks[k] for k in order]
    sizes = [chunk_bytes(c) for c in chunks]
    tiers, parts = [c.tier for c in chunks], [chunk_part(c.key) for c in chunks]
    groups = group_chunks(sizes, tiers, parts, in_flight, slot_bytes)
    # The groups that may run between microbatches come first: the others move more than a
    # slot (`slot_order`), fetched after the last microbatch.
    moved_bytes = [sum(sizes[k] for k in ks if tiers[k] != DEVICE) for ks in groups]
    return Schedule(
        chunks=chunks,
        groups=groups,
        group_bytes=[sum(sizes[k] for k in ks) for ks in groups],
        moved_bytes=moved_bytes,
        between_groups=sum(not slot_bytes or n <= slot_bytes for n in moved_bytes),
        last_group={chunks[k].weight: g for g, ks in enumerate(groups) for k in ks},
        parts=parts,
        in_flight=in_flight,
        ahead=ahead,
        leaving=leaving,
    )


class GroupCopies:
    """A group's copies between its tier and the device, apart from its program: fetched,
    taken in on the device, and sent home, where `homebound` holds what they read until done.

    The copies are runtime transfers, not copies inside one program: XLA runs one program's
    host->device and device->host copies one after the other (an in-jit update took the sum
    of both directions' copy times), while the runtime uses one stream for each direction."""

    def __init__(self, chunks: list[Chunk], groups: list[list[int]], ssd, slot_bytes: int):
        self.chunks, self.groups, self.ssd, self.slot_bytes = chunks, groups, ssd, slot_bytes
        self.moves = Moves(chunks)
        self.homebound = Homebound()  # The groups on their way home.

    def is_home(self, g: int, masters: list, states: list) -> bool:
        """Whether group g's host copies are all written (an SSD group is read on threads)
        and its device outputs gone (else it would be on the device twice).

        `StreamedUpdate.prefetch` leaves a group not home to the update: on the GPU the step
        dispatched after a copy from an array not yet written waited for that array (the grad
        step's dispatch waited 65 ms, until the last copies home were done)."""
        ks = self.groups[g]
        if self.chunks[ks[0]].tier == SSD:
            return True
        if any(e[3] == g for e in self.homebound):
            return False
        leaves = [self.moves.leaves(k, masters, states) for k in ks]
        return all(x.is_ready() for x in self.moves.moved(ks, leaves))

    def fetch(self, g: int, masters: list, states: list):
        """Group g on its way to the device: its chunks' leaves, or for the SSD tier (a group
        of one) futures of (master, state) read on the SSD's threads."""
        ks = self.groups[g]
        if self.chunks[ks[0]].tier == SSD:
            fetched = self.ssd.read(self.chunks[ks[0]])
        else:
            leaves = [self.moves.leaves(k, masters, states) for k in ks]
            fetched = self.moves.move(ks, leaves, to_device=True)
        dispatch.mark(dispatch.FETCHED_GROUP)
        return fetched

    def take_in(self, g: int, fetched, masters: list, states: list) -> tuple[list, list]:
        """Group g's leaves on the device from what `fetch` returned, and the caller's old host
        copies, which its copies home delete once they are done (none for the SSD tier)."""
        ks = self.groups[g]
        if self.chunks[ks[0]].tier == SSD:
            master, state = (f.result() for f in fetched)
            return self.moves.move(ks, [[master, *jax.tree.leaves(state)]], to_device=True), []
        # The caller's host copies (its state is donated), deleted once read.
        old = self.moves.moved(ks, [self.moves.leaves(k, masters, states) for k in ks])
        if self.slot_bytes and old:
            # A slot's group is large: its host copies go, once copied up, before
            # its new ones come, or the pinned pool would hold it twice (the 8B's
            # 6 GiB groups ran it out of memory).
            moves.wait(self.moves.moved(ks, fetched))
            moves.delete(old)
            old = []
        return fetched, old

    def send_home(self, g: int, new: tuple, masters: list, states: list, old: list) -> None:
        """Group g's `new` (masters, states) on their way home: written to disk, or copied to
        host memory into `masters` and `states`, with `old` deleted once they are there."""
        ks, (new_masters, new_states) = self.groups[g], new
        group = [self.chunks[k] for k in ks]
        outs = [[m, *jax.tree.leaves(st)] for m, st in zip(new_masters, new_states, strict=True)]
        if group[0].tier == SSD:  # The writes hold the device outputs until written.
            writes = list(self.ssd.put(group[0], new_masters[0], new_states[0]))
            self.homebound.append([writes, [], [], g])
            return
        device_outs = self.moves.moved(ks, outs)
        outs = self.moves.move(ks, outs, to_device=False)
        for k, c, x in zip(ks, group, outs, strict=True):
            _put(masters, c, x[0])
            _put(states, c, self.moves.state(k, x[1:]))
        if device_outs:  # A group resident on the device has nothing on its way.
            self.homebound.append([self.moves.moved(ks, outs), device_outs, old, g])


def run_out(stages):
    """`stages` (a generator `StreamedUpdate.stages` returned) run to its end: its value."""
    while True:
        try:
            next(stages)
        except StopIteration as end:
            return end.value


class StreamedUpdate:
    """The ZeRO-Cache optimizer update, run after the jitted forward/backward step: each chunk's
    master and state are copied to the device, updated there, and copied back to their tier
    (read from and written to disk for the SSD tier); its new compute copy goes straight into
    the stacked compute buffer (donated, on the device or in host memory).

    Consecutive chunks of one tier move and update together, as a group (`update_schedule`),
    by runtime transfers (`GroupCopies`). Group k + `in_flight` // 2 is fetched while group k
    is updated, once the oldest groups on their way home (this update's or the last one's) are
    home, so that the device holds at most `in_flight` groups, fetched or on their way home:
    the first ones fetched before the step (`prefetch`), the last ones home beside the next.

    A delayed update between the next step's microbatches (`slot_bytes`, `Plan.slot_bytes`)
    takes groups of that many bytes moved, two on the device at most: `stages` stops after
    each, so that a microbatch is dispatched between them (`slots`). Chunks larger than a slot
    come last, groups of their own, fetched after the last microbatch, and the last of them
    goes home before the next step."""

    def __init__(
        self,
        optimizer: Optimizer,
        chunks: list[Chunk],
        in_flight: int,
        ssd=None,
        cpu=None,
        beside_step: bool = True,
        slot_bytes: int = 0,
    ):
        schedule = update_schedule(chunks, in_flight, slot_bytes)
        self.chunks, self.groups = schedule.chunks, schedule.groups
        self.in_flight, self.ahead = schedule.in_flight, schedule.ahead
        self.leaving, self.last_group = schedule.leaving, schedule.last_group
        self.group_bytes, self.moved_bytes = schedule.group_bytes, schedule.moved_bytes
        self.between_groups, self.cpu = schedule.between_groups, cpu
        # Whether groups are fetched before the step and go home beside the next one (the
        # plan's `copies_beside_step`, when the step's activations leave room for them:
        # `groups.beside_step_groups` counts them): else the update ends with every copy home.
        self.beside_step = beside_step
        self.most_in_flight = 0  # The most groups on the device at once, as scheduled.
        self.most_bytes_in_flight = 0  # Their bytes (per device).
        self.programs = GroupPrograms(optimizer, self.chunks, schedule.parts)
        self.copies = GroupCopies(self.chunks, self.groups, ssd, slot_bytes)
        self.moves, self.homebound = self.copies.moves, self.copies.homebound

    def prefetch(self, masters: list, states: list) -> dict:
        """Starts the first `in_flight` // 2 groups' copies to the device (arguments as
        `__call__`'s), for `__call__`'s `fetched`: call it before dispatching the step whose
        grads the update takes, so the copies run beside that step. The host copies stay until
        the update reads them: an update left out (an anomalous step) loses nothing.

        The runtime starts a copy only after the device work queued before it, and runs it
        beside the work queued after it (experiments/copy_overlap_probe.py: 8 GiB down queued
        before a 165 ms program took 167 ms in all, queued after it 319): hence these fetches
        before the step, and the last groups' copies home beside the next one (`beside_step`)."""
        self.homebound.delete_ready()  # The groups home leave the device before more come.
        if not self.beside_step:
            return {}
        first = range(min(self.ahead, self.between_groups))
        home = lambda g: self.copies.is_home(g, masters, states)
        return {g: self.fetch(g, masters, states) for g in first if home(g)}

    def fetch(self, g: int, masters: list, states: list):
        """Group g on its way to the device (`GroupCopies.fetch`): the update's every fetch."""
        return self.copies.fetch(g, masters, states)

    def __call__(self, *args, **kwargs):
        """Updates every chunk with its grad times `scale` (the clipping factor): `stages`
        run to its end, its result returned."""
        return self.run_out(self.stages(*args, **kwargs))

    run_out = staticmethod(run_out)

    def slots(self, count: int) -> list[int]:
        """How many of `stages`' groups to dispatch after each of `count` programs that the
        update runs between (the next step's microbatches): one a program (a group is a
        slot's, `Plan.slot_bytes`), fetched before the program before it is dispatched so
        that its copies run beside it. Groups past the slots, and those larger than a slot,
        run after the last program."""
        return [int(i < self.between_groups) for i in range(count)]

    def stages(
        self,
        grads: list,
        scale,
        masters: list,
        states: list,
        compute: list,
        on_cpu=None,
        fetched=None,
        into_new: bool = False,
    ):
        """`__call__`'s update as a generator that stops after its first fetches and after
        each group's dispatch, so that other programs can be dispatched between its groups
        (`slots`); its value, at the end, is `__call__`'s.

        Arguments are flat lists over the params' leaves: `grads` and `compute` stacked for
        stacked weights (grads may instead be tuples of layers), `masters` and `states` tuples
        of layers for stacked weights, with None for chunks on the SSD tier; `on_cpu`: the
        host's share as `start_on_cpu` returned it, if started already; `fetched`: what
        `prefetch` returned for these masters and states. Returns the new (masters, states,
        compute) likewise; donates `masters`, `states` and `compute`. With `into_new` the
        groups' programs leave `compute` as it was, for programs dispatched between them to
        read (`_NewCompute`). A weight's grads are let go after its last group.
        """
        run = _Run.start(self, grads, scale, masters, states, compute, on_cpu, fetched, into_new)
        # `run` holds copies of the lists: these would keep every grad alive to the end.
        del grads, masters, states, compute, on_cpu, fetched
        yield  # The first groups are on their way.
        for g in range(len(self.groups)):
            run.update_group(g)
            yield
        return run.finish()

    def drain(self) -> None:
        """Sends off every group on its way home (`Homebound.drain`), e.g. before a rollback."""
        self.homebound.drain()

    def start_on_cpu(self, grads: list, scale, compute: list) -> list:
        """Starts the host cores' share (`cpu.CPUTier.update`; arguments as `__call__`'s)."""
        return self.cpu.update(grads, scale, compute) if self.cpu else []


class _NewCompute:
    """The compute copy one update makes: each group's program's written in place of the old,
    or with `into_new` its chunks' parts (a layer of a stacked weight, or a weight whole),
    which wait beside it and go into it in place once the last group is dispatched.

    So the compute copy keeps its buffers from step to step: new ones made each step at other
    addresses, around a microbatch's temporaries' block freed as it is queued, fragment the
    device pool (`experiments/allocator_model.py`, a model of XLA's best-fit pool fed the 8B's
    groups: with new buffers its fifth step finds no 37.5 GiB block with 43 GiB free; in
    place it runs 40)."""

    def __init__(self, compute: list, into_new: bool):
        self.compute, self.into_new = list(compute), into_new
        # Weight -> [(layer, its new part)] still to write into `compute`: the device's with
        # `into_new`, and the host cores'.
        self.parts = collections.defaultdict(list)

    def take(self, group: list[Chunk], weights: list[int], new: list) -> None:
        """A group's program's new compute copy (`weights`' whole, or with `into_new` its
        chunks' parts)."""
        if self.into_new:
            for c, x in zip(group, new, strict=True):
                self.parts[c.weight].append((c.layer, x))
        else:
            for w, x in zip(weights, new, strict=True):
                self.compute[w] = x

    def written(self, on_cpu: list, cpu) -> list:
        """The new compute copy, the host cores' parts (`on_cpu`) and the kept ones written
        into it."""
        start = time.perf_counter()
        for c, new in on_cpu:  # The host cores' parts, copied up as they are written.
            self.parts[c.weight].append((c.layer, new.result()))
        if cpu:  # Waited for the host's cores.
            cpu.seconds["waited after the device's chunks"] += time.perf_counter() - start
        for w, parts in self.parts.items():
            self.compute[w] = _write_parts(self.compute[w], parts)
        return self.compute


@dataclasses.dataclass
class _Run:
    """One `StreamedUpdate.stages` run: its state, its lists updated group by group."""

    update: StreamedUpdate
    grads: list
    scale: object
    masters: list
    states: list
    compute: _NewCompute
    on_cpu: list
    fetched: dict
    older: list  # The last update's groups still on their way home (their entries).
    stacked: set  # The stacked weights (flat indices).

    @classmethod
    def start(cls, update, grads, scale, masters, states, compute, on_cpu, fetched, into_new):
        """`stages`' first fetches: its run, the first groups on their way."""
        update.homebound.delete_ready()
        grads = list(grads)
        # The last update's groups still on their way home (at the deque's left end).
        # The entries themselves, not their ids: an entry sent off meanwhile is freed, and a
        # new entry may take its id.
        older = list(update.homebound)
        # The host's cores start on theirs (hybrid update) while the device works on its own.
        if on_cpu is None:
            on_cpu = update.start_on_cpu(grads, scale, compute)
        fetched = dict(update.prefetch(masters, states) if fetched is None else fetched)
        for g in range(min(update.ahead, update.between_groups)):  # Those `prefetch` left.
            if g not in fetched:
                fetched[g] = update.fetch(g, masters, states)
        stacked = {c.weight for c in update.chunks if c.layer is not None}
        masters, states = (
            [list(x) if w in stacked else x for w, x in enumerate(tree)]
            for tree in (masters, states)
        )
        compute = _NewCompute(compute, into_new)
        return cls(update, grads, scale, masters, states, compute, on_cpu, fetched, older, stacked)

    def update_group(self, g: int) -> None:
        """Group g's update dispatched: fetched if it is not yet, its program run, its
        copies home started, and the group `ahead` of it fetched."""
        update, fetched, masters, states = self.update, self.fetched, self.masters, self.states
        if g not in fetched:  # Larger than a slot: fetched after the last microbatch.
            update.homebound.make_room(fetched, update.in_flight)
            fetched[g] = update.fetch(g, masters, states)
            self._count_in_flight()
        leaves, old = update.copies.take_in(g, fetched.pop(g), masters, states)
        new = self._run_program(g, leaves)
        update.copies.send_home(g, new, masters, states, old)
        nxt, between = g + update.ahead, update.between_groups
        # The first group larger than a slot waits for the microbatches (it is fetched
        # when its turn comes, after the last one).
        if nxt < len(update.groups) and (nxt < between or g >= between):
            update.homebound.make_room(fetched, update.in_flight)
            fetched[nxt] = update.fetch(nxt, masters, states)
        self._count_in_flight()

    def _run_program(self, g: int, leaves: list) -> tuple[list, list]:
        """Group g's program dispatched on its fetched `leaves`: its new (masters, states),
        its new compute copy to `compute`. A weight's grads go after its last group."""
        update, grads, compute, ks = self.update, self.grads, self.compute, self.update.groups[g]
        group = [update.chunks[k] for k in ks]
        weights = list(dict.fromkeys(c.weight for c in group))
        layer_grads = [
            grads[c.weight][c.layer] if isinstance(grads[c.weight], tuple) else grads[c.weight]
            for c in group
        ]
        program = update.programs.get(ks, layer_grads, compute.compute, compute.into_new)
        dispatch.mark(dispatch.UPDATE_GROUP)
        new_masters, new_states, new_compute = program(
            layer_grads,
            [layer_index(c.master_sharding.mesh, c.layer or 0) for c in group],
            self.scale,
            [x[0] for x in leaves],
            [update.moves.state(k, x[1:]) for k, x in zip(ks, leaves, strict=True)],
            [compute.compute[w] for w in weights],
        )
        compute.take(group, weights, new_compute)
        for w in weights:
            if update.last_group[w] == g:
                grads[w] = None  # Its arrays go once the programs reading them are done.
        return new_masters, new_states

    def finish(self):
        """`stages`' value: the groups left on their way home trimmed, the host cores'
        parts and the device's (`into_new`) written into the compute copy."""
        update, n = self.update, len(self.update.groups)
        # This update's last groups on their way home stay on the device beside the next
        # step, as many as the planner counts (`groups.beside_step_groups`): older ones, and
        # the last update's (with fewer groups than that they would pile up), are waited for
        # first, and only then the ones home meanwhile go (else an older one would stay).
        # A group larger than a slot does not stay beside the next step's microbatch.
        keep = update.leaving if update.beside_step and update.between_groups == n else 0
        update.homebound.keep_last(keep, self.older)
        update.homebound.delete_ready()
        compute = self.compute.written(self.on_cpu, update.cpu)
        tuples = lambda tree: [tuple(x) if w in self.stacked else x for w, x in enumerate(tree)]
        return tuples(self.masters), tuples(self.states), compute

    def _count_in_flight(self) -> None:
        """The update's `most_in_flight` and `most_bytes_in_flight` with the groups on the
        device now."""
        update = self.update
        on_device = [*self.fetched, *(e[3] for e in update.homebound)]
        update.most_in_flight = max(update.most_in_flight, len(on_device))
        update.most_bytes_in_flight = max(
            update.most_bytes_in_flight, sum(update.group_bytes[h] for h in on_device)
        )


def _put(tree: list, c: Chunk, value) -> None:
    """`value` in chunk c's place of a flat (masters or states) list."""
    if c.layer is None:
        tree[c.weight] = value
    else:
        tree[c.weight][c.layer] = value


def chunk_bytes(c: Chunk) -> int:
    """A chunk's master and optimizer state bytes on one device."""
    return local_bytes([c.master, c.state])


def _write_parts(compute: jax.Array, written: list) -> jax.Array:
    """`compute` with each of `written`'s (layer, new part) in its place, in place (donated):
    a stacked weight's layers, or (layer None) the weight whole; parts in pinned host memory
    (the host cores' share) are copied up by the program."""
    if [layer for layer, _ in written] == [None]:
        return _overwrite(compute.sharding)(compute, written[0][1])
    mesh = compute.sharding.mesh
    layers = [layer_index(mesh, layer) for layer, _ in written]
    return _set_layers(compute.sharding)(compute, [x for _, x in written], layers)


@functools.cache
def _set_layers(sharding):
    def write_new_compute_copy(stacked, news, layers):  # Named for profiles and errors.
        space = jax.typeof(stacked).memory_space
        for new, layer in zip(news, layers, strict=True):
            new = jax.device_put(new, space)
            stacked = jax.lax.dynamic_update_index_in_dim(stacked, new, layer, 0)
        return stacked

    return jax.jit(write_new_compute_copy, out_shardings=sharding, donate_argnums=0)


@functools.cache
def _overwrite(sharding):
    def write_new_compute_copy(old, new):
        new = jax.device_put(new, jax.typeof(old).memory_space)
        return jax.lax.dynamic_update_slice(old, new, (0,) * old.ndim)

    return jax.jit(write_new_compute_copy, out_shardings=sharding, donate_argnums=0)


@functools.cache
def layer_index(mesh, layer: int) -> jax.Array:
    """A layer as a replicated device scalar, made once (no host->device copy per step)."""
    return jax.device_put(np.int32(layer), NamedSharding(mesh, P()))
