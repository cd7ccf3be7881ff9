"""Pipeline parallelism on the `pipeline` mesh axis: GPipe, 1F1B and circular (virtual stage)
schedules, each run as one jitted program.

Layout. The model's layers are cut into S = p x v chunks of consecutive layers (p stages, v
virtual stages each); chunk k lives on stage k mod p, so a circular schedule passes every
microbatch around the ring v times. Chunks may hold different numbers of layers (the planner
balances them): each is padded to the longest, and a padded slot is skipped with `lax.cond`.
The stacked layer weights are stored stage-major, (p x v x slots, ...), split over `pipeline`.
The embedding runs in the first chunk, the final norm, LM head and loss in the last.

Why shard_map (manual over `pipeline` only) and not a vmap over stages: a stage skips work
that is not its own (padded layer slots, the embedding, the head, ticks with nothing to do)
with `lax.cond`, and under vmap a per-stage predicate turns `cond` into `select`, which runs
both branches on every stage. The other mesh axes stay automatic inside the region, so data
(ZeRO), tensor and context parallelism work inside a stage as they do without a pipeline.

Execution. A schedule is a table: at each tick every stage runs at most one forward (F) and
then at most one backward (B) of some (microbatch, chunk). One `lax.scan` runs the ticks. F
runs its chunk on the activation the previous stage sent at the last tick, keeps that input
in a slot buffer and sends its output on (`ppermute`); B runs the chunk again from the kept
input under `jax.vjp` (recomputation at stage boundaries, as in the GPipe paper), adds the
weight grads to accumulators and sends the input's grad back. The last chunk's F only keeps
its input, as its B computes the head and the loss anyway. Each tick's F phase and B phase end
in a `ppermute`, so a tick lasts as long as the slowest F plus the slowest B.

Schedules differ in when B runs: GPipe and circular run every F, then every B in reverse, so
a stage keeps the inputs of all its microbatches (m x v); 1F1B runs B of a microbatch as soon
as its grad arrives, so stage s keeps at most 2(p - s) - 1 (one F and one B share a tick, so
the round trip to the last stage and back takes twice as many ticks as classic 1F1B's
alternation, which keeps p - s; the bubble is the same). Bubble: (p-1)/(v m + p-1).

Letters: M microbatches, B rows per microbatch, T length, D model dim.
"""

import contextlib
import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from angel_jax import sharding
from angel_jax.config import ConfigError
from angel_jax.sharding import shard_map_mesh

SCHEDULES = ("gpipe", "1f1b", "circular")
IDLE = -1  # A table entry's microbatch when the stage has nothing to do.


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Per tick and stage, the (microbatch, chunk on the stage, input slot) of its forward and
    of its backward; microbatch IDLE where there is none."""

    name: str
    stages: int
    microbatches: int
    virtual: int
    forward: np.ndarray  # (ticks, stages, 3) int32.
    backward: np.ndarray  # (ticks, stages, 3) int32.
    slots: int  # Chunk inputs a stage keeps at once (the live activations).

    @property
    def ticks(self) -> int:
        return self.forward.shape[0]

    def bubble(self, forward_cost: float = 1.0, backward_cost: float = 2.0) -> float:
        """Idle share of the stages' time when every F costs `forward_cost` and every B
        `backward_cost`: a tick's F phase lasts if any stage runs an F, its B phase likewise."""
        any_f = (self.forward[..., 0] != IDLE).any(axis=1)
        any_b = (self.backward[..., 0] != IDLE).any(axis=1)
        total = any_f.sum() * forward_cost + any_b.sum() * backward_cost
        busy = self.microbatches * self.virtual * (forward_cost + backward_cost)
        return float(1.0 - busy / total)

    def live(self) -> np.ndarray:
        """Inputs kept per stage during each tick (its B still needs them): (ticks, stages)."""
        backward = self.backward[..., 0] != IDLE
        started = np.cumsum(self.forward[..., 0] != IDLE, axis=0)
        return started - (np.cumsum(backward, axis=0) - backward)


def theoretical_bubble(stages: int, microbatches: int, virtual: int = 1) -> float:
    return (stages - 1) / (virtual * microbatches + stages - 1)


def make_schedule(name: str, stages: int, microbatches: int, virtual: int = 1) -> Schedule:
    """The tick table of schedule `name`. Stage s's n-th work item (n < v m) is microbatch
    (n // (v p)) p + n % p on its chunk (n // p) % v: microbatches go in groups of p, each group
    around the ring v times (for v = 1, item n is microbatch n)."""
    p, m, v = stages, microbatches, virtual
    if name not in SCHEDULES:
        raise ConfigError(f"config.pipeline.schedule={name!r}: use one of {', '.join(SCHEDULES)}")
    if v > 1 and name != "circular":
        raise ConfigError(
            f"config.pipeline.virtual_stages={v} needs config.pipeline.schedule=circular "
            f"(here {name}); or set virtual_stages=1"
        )
    if v > 1 and m % p:
        raise ConfigError(
            f"config.pipeline.microbatches={m} is not divisible by config.mesh.pipeline={p}: "
            "the circular schedule sends microbatches round the ring in groups of p"
        )
    items = v * m
    n = np.arange(items)
    mb = (n // (v * p)) * p + n % p
    chunk = (n // p) % v
    s = np.arange(p)[:, None]
    f_tick = n[None, :] + s
    if name == "1f1b":  # The last stage runs B right after F; each hop back takes a tick.
        b_tick = n[None, :] + 2 * (p - 1) - s
    else:  # Every F first (the last one at tick v m + p - 2), then every B in reverse.
        b_tick = (items + p - 2) + (items - 1 - n[None, :]) + (p - 1 - s)
    ticks = int(b_tick.max()) + 1
    forward = np.full((ticks, p, 3), IDLE, np.int32)
    backward = np.full((ticks, p, 3), IDLE, np.int32)
    slots = 0
    for stage in range(p):
        free, holder = [], {}
        for t in range(ticks):  # Lowest free slot at F (before this tick's B frees one).
            for item in np.flatnonzero(f_tick[stage] == t):
                slot = free.pop(0) if free else len(holder) + len(free)
                holder[item] = slot
                forward[t, stage] = (mb[item], chunk[item], slot)
                slots = max(slots, slot + 1)
            for item in np.flatnonzero(b_tick[stage] == t):
                slot = holder.pop(item)
                backward[t, stage] = (mb[item], chunk[item], slot)
                free = sorted([*free, slot])
    return Schedule(name, p, m, v, forward, backward, slots)


@dataclasses.dataclass(frozen=True)
class StageLayout:
    """Where each layer lives: chunk k holds `layers_per_chunk[k]` consecutive layers, padded
    to `slots` layer slots; storage is stage-major (stage, chunk on the stage, slot)."""

    stages: int
    virtual: int
    layers_per_chunk: tuple[int, ...]

    @property
    def slots(self) -> int:
        return max(self.layers_per_chunk)

    @functools.cached_property
    def slot_layer(self) -> np.ndarray:
        """(stages x virtual x slots,) the model layer of each stored slot, -1 for padding."""
        p, v = self.stages, self.virtual
        first = np.concatenate([[0], np.cumsum(self.layers_per_chunk)])
        table = np.full((p, v, self.slots), -1, np.int64)
        for k, count in enumerate(self.layers_per_chunk):
            table[k % p, k // p, :count] = np.arange(first[k], first[k] + count)
        return table.reshape(-1)

    def mask(self) -> np.ndarray:
        """(stages x virtual, slots) true where a slot holds a layer."""
        return (self.slot_layer >= 0).reshape(-1, self.slots)

    def to_stages(self, stacked):
        """A (layers, ...) stacked weight -> its stored (stages x virtual x slots, ...) form,
        padding slots zero (they stay zero: their grads are zero, and so is their decay)."""
        index = np.maximum(self.slot_layer, 0)
        keep = (self.slot_layer >= 0).reshape(-1, *[1] * (stacked.ndim - 1))
        return jnp.where(keep, stacked[index], 0).astype(stacked.dtype)

    def from_stages(self, stored):
        """The inverse of `to_stages`: the (layers, ...) stacked weight."""
        slots = np.flatnonzero(self.slot_layer >= 0)
        return stored[slots[np.argsort(self.slot_layer[slots])]]


@dataclasses.dataclass(frozen=True)
class StageFunctions:
    """The model cut for the pipeline (all traced inside the stage region):
    embed(shared, tokens_BT) -> h_BTD; layer(layer_params, h_BTD) -> h_BTD;
    head_loss(shared, h_BTD, targets_BT) -> (objective, metrics)."""

    embed: Callable
    layer: Callable
    head_loss: Callable


def pipeline_grads(
    schedule: Schedule,
    layout: StageLayout,
    fns: StageFunctions,
    mesh: Mesh,
    layers,
    shared,
    tokens_MBT: jax.Array,
    targets_MBT: jax.Array,
    hidden_spec: P,
    grad_specs,
):
    """(metrics averaged over microbatches, grads of `layers` (stored form, float32), grads of
    `shared` (float32)) of the mean objective over microbatches. `layers`: the stacked layer
    weights in stored form; `shared`: the rest (embedding, final norm, head), on every stage;
    `hidden_spec`: the layout of one microbatch's hidden states (B, T, D) over the automatic
    axes; `grad_specs`: the grads' layouts, like {"layers": ..., **shared}. Each `lax.cond`'s
    branches give their outputs the same layout (XLA requires it)."""
    p, v, m = schedule.stages, schedule.virtual, schedule.microbatches
    b, t = tokens_MBT.shape[1:]
    h_shape = jax.eval_shape(fns.embed, shared, tokens_MBT[0])
    d, dtype = h_shape.shape[-1], h_shape.dtype
    _, metrics_shape = jax.eval_shape(fns.head_loss, shared, h_shape, targets_MBT[0])
    zeros = lambda tree, dtype=None: jax.tree.map(
        lambda x: jnp.zeros(x.shape, dtype or x.dtype), tree
    )
    # Manual over the pipeline axis only, unless it is the mesh's one split axis: then manual
    # over all (cuDNN attention's custom partitioner fails in a partly manual region), with
    # nothing left to lay out inside.
    fully_manual = {a for a in mesh.axis_names if mesh.shape[a] > 1} <= {"pipeline"}
    pin = lambda x, spec=hidden_spec: (
        x
        if fully_manual
        else jax.lax.with_sharding_constraint(
            x, jax.sharding.NamedSharding(shard_map_mesh(mesh), spec)
        )
    )
    # Inside the stage region: the layer grads as (chunk, slot, ...), `pipeline` left out.
    layer_grad_specs = jax.tree.map(
        lambda spec: P(None, None, *spec[1:]),
        grad_specs["layers"],
        is_leaf=lambda x: isinstance(x, P),
    )
    shared_grad_specs = {name: spec for name, spec in grad_specs.items() if name != "layers"}
    pin_grads = lambda grads, shared_grads: (
        jax.tree.map(pin, grads, layer_grad_specs),
        jax.tree.map(pin, shared_grads, shared_grad_specs),
    )

    kept_spec = P(None, *hidden_spec)

    def run_chunk(chunk_layers, mask, h):
        def body(h, xs):
            layer_params, present = xs
            layer = lambda params, h: pin(fns.layer(params, h))
            return jax.lax.cond(present, layer, lambda _, h: pin(h), layer_params, h), None

        return jax.lax.scan(body, h, (chunk_layers, mask))[0]

    def stage(layers, mask, shared, tokens, targets, forward_table, backward_table):
        s = jax.lax.axis_index("pipeline")
        # (v x slots, ...) on this stage -> (v, slots, ...): its chunks.
        layers = jax.tree.map(lambda x: x.reshape(v, -1, *x.shape[1:]), layers)
        pick = lambda tree, i: jax.tree.map(lambda x: x[i], tree)
        is_first = lambda chunk: (s == 0) & (chunk == 0)
        is_last = lambda chunk: (s == p - 1) & (chunk == v - 1)

        def chunk_forward(chunk_layers, shared, x, chunk, mb):
            """The chunk's output and (on the last chunk) the objective and metrics."""
            h = jax.lax.cond(
                is_first(chunk), lambda: pin(fns.embed(shared, tokens[mb])), lambda: pin(x)
            )
            h = pin(run_chunk(chunk_layers, mask[chunk], pin(h)))

            def head():
                return fns.head_loss(shared, h, targets[mb])

            def no_head():
                return jnp.zeros((), jnp.float32), zeros(metrics_shape)

            objective, metrics = jax.lax.cond(is_last(chunk), head, no_head)
            return (h, objective), metrics

        def tick(carry, rows):
            recv_f, recv_b, kept, grads, shared_grads, sums = carry
            (mb, chunk, slot), (b_mb, b_chunk, b_slot) = rows[0][0], rows[1][0]

            # F: keep the input, run the chunk (not the last: its B does), send the output on.
            active = mb != IDLE
            slot = jnp.maximum(slot, 0)
            kept = pin(kept.at[slot].set(jnp.where(active, recv_f, kept[slot])), kept_spec)
            out = jax.lax.cond(
                active & ~is_last(chunk),
                lambda: chunk_forward(pick(layers, chunk), shared, recv_f, chunk, mb)[0][0],
                lambda: pin(jnp.zeros_like(recv_f)),
            )
            recv_f = pin(jax.lax.ppermute(out, "pipeline", [(i, (i + 1) % p) for i in range(p)]))

            # B: recompute the chunk from its kept input, add its grads, send the input's back.
            def backward(grads, shared_grads, sums):
                chunk_fn = functools.partial(chunk_forward, chunk=b_chunk, mb=b_mb)
                (_, objective), vjp, metrics = jax.vjp(
                    chunk_fn, pick(layers, b_chunk), shared, kept[b_slot], has_aux=True
                )
                # The last chunk's output only feeds its loss; the mean over microbatches
                # gives each microbatch's objective weight 1/m.
                g_out = jnp.where(is_last(b_chunk), jnp.zeros_like(recv_b), recv_b)
                d_layers, d_shared, d_x = vjp((g_out, jnp.full((), 1.0 / m, jnp.float32)))
                grads = jax.tree.map(
                    lambda acc, g: acc.at[b_chunk].add(g.astype(jnp.float32)), grads, d_layers
                )
                shared_grads = jax.tree.map(
                    lambda acc, g: acc + g.astype(jnp.float32), shared_grads, d_shared
                )
                sums = jax.tree.map(jnp.add, sums, {"objective": objective, **metrics})
                return pin(d_x.astype(recv_b.dtype)), *pin_grads(grads, shared_grads), sums

            def idle(grads, shared_grads, sums):
                return pin(jnp.zeros_like(recv_b)), *pin_grads(grads, shared_grads), sums

            d_x, grads, shared_grads, sums = jax.lax.cond(
                b_mb != IDLE, backward, idle, grads, shared_grads, sums
            )
            recv_b = pin(jax.lax.ppermute(d_x, "pipeline", [(i, (i - 1) % p) for i in range(p)]))
            return (recv_f, recv_b, kept, grads, shared_grads, sums), None

        zeros_h = pin(jnp.zeros((b, t, d), dtype))
        kept = pin(jnp.zeros((schedule.slots, b, t, d), dtype), kept_spec)
        sums = zeros({"objective": jax.ShapeDtypeStruct((), jnp.float32), **metrics_shape})
        grads = pin_grads(zeros(layers, jnp.float32), zeros(shared, jnp.float32))
        carry = (zeros_h, zeros_h, kept, *grads, sums)
        carry, _ = jax.lax.scan(tick, carry, (forward_table, backward_table))
        _, _, _, grads, shared_grads, sums = carry
        # Only the first stage has embedding grads, only the last head grads and metrics.
        shared_grads, sums = jax.lax.psum((shared_grads, sums), "pipeline")
        grads = jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), grads)
        return jax.tree.map(lambda x: x / m, sums), grads, shared_grads

    on_stages = P("pipeline")
    layer_specs = jax.tree.map(lambda _: on_stages, layers)
    table_spec = P(None, "pipeline")
    run = jax.shard_map(
        stage,
        mesh=mesh,
        in_specs=(layer_specs, on_stages, P(), P(), P(), table_spec, table_spec),
        out_specs=(P(), layer_specs, P()),
        axis_names=set(mesh.axis_names) if fully_manual else {"pipeline"},
        check_vma=False,
    )
    with sharding.no_rules() if fully_manual else contextlib.nullcontext():
        return run(
            layers,
            jnp.asarray(layout.mask()),
            shared,
            tokens_MBT,
            targets_MBT,
            jnp.asarray(schedule.forward),
            jnp.asarray(schedule.backward),
        )
