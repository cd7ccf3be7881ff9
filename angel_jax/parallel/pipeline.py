"""Pipeline parallelism on the `pipeline` mesh axis: GPipe, 1F1B and circular (virtual stage)
schedules, each run as one jitted program.

Layout. The model's layers are cut into S = p x v chunks of consecutive layers (p stages, v
virtual stages each); chunk k lives on stage k mod p, so a circular schedule passes every
microbatch around the ring v times. Chunks may hold different numbers of layers (the planner
balances them): each is padded to the longest, and a padded slot is skipped with `lax.cond`
(or, with `context` split, run on its zero weights: see `_Program.uniform`).
The stacked layer weights are stored stage-major, (p x v x slots, ...), split over `pipeline`.
The embedding runs in the first chunk, the final norm, LM head and loss in the last.

Why shard_map (manual over `pipeline` only) and not a vmap over stages: a stage skips work
that is not its own (padded layer slots, the embedding, the head, ticks with nothing to do)
with `lax.cond`, and under vmap a per-stage predicate turns `cond` into `select`, which runs
both branches on every stage. The other mesh axes stay automatic inside the region, so data
(ZeRO), tensor and context parallelism work inside a stage as they do without a pipeline.

Execution. A schedule is a table: at each tick every stage runs at most one forward (F) and
then at most one backward (B) of some (microbatch, chunk). One `lax.scan` runs the ticks. F
runs its chunk on the activation the previous stage sent at the last tick (the last chunk also
runs the head and the loss) under `jax.vjp`, layer by layer, keeps the residuals that each
layer's remat policy saves in a slot buffer, and sends its output on (`ppermute`). B runs the
chunk's backward from those residuals, adds the weight grads to accumulators and sends the
input's grad back. No forward runs twice, except what the remat policy recomputes and the
head (its logits are not kept). The weights are residuals too; they are not stored per slot
but looked up again in B (`Residuals`). Each tick's F phase and B phase end in a `ppermute`,
so a tick lasts as long as the slowest F plus the slowest B.

Schedules differ in when B runs: GPipe and circular run every F, then every B in reverse, so
a stage keeps the residuals of all its microbatches (m x v); 1F1B runs B of a microbatch as soon
as its grad arrives, so stage s keeps at most 2(p - s) - 1 (one F and one B share a tick, so
the round trip to the last stage and back takes twice as many ticks as classic 1F1B's
alternation, which keeps p - s; the bubble is the same). 1F1B with v > 1 virtual stages is
Megatron's interleaved 1F1B: microbatches go round the ring in groups of p as in circular, and
a group's backward starts once its last chunk's forward is done, so stage s keeps at most
(v - 1) p + 2(p - s) - 1 chunk items however many microbatches run. Bubble: (p-1)/(v m + p-1).

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
from angel_jax.config import SCHEDULES, ConfigError
from angel_jax.mesh import CONTEXT, PIPELINE
from angel_jax.sharding import shard_map_mesh

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
    slots: int  # Microbatches whose residuals a stage keeps at once (F done, B not yet).

    @property
    def ticks(self) -> int:
        return self.forward.shape[0]

    def bubble(self, forward_cost: float = 1.0, backward_cost: float = 2.0) -> float:
        """Idle share of the stages' time when every F costs `forward_cost` and every B
        `backward_cost`: a tick's F phase lasts if any stage runs an F, its B phase likewise."""
        any_f, any_b = self.busy_ticks().T
        total = any_f.sum() * forward_cost + any_b.sum() * backward_cost
        busy = self.microbatches * self.virtual * (forward_cost + backward_cost)
        return float(1.0 - busy / total)

    def busy_ticks(self) -> np.ndarray:
        """(ticks, 2) whether any stage runs an F, a B, at each tick."""
        return np.stack(
            [
                (self.forward[..., 0] != IDLE).any(axis=1),
                (self.backward[..., 0] != IDLE).any(axis=1),
            ],
            axis=1,
        )

    def live(self) -> np.ndarray:
        """Microbatches kept per stage during each tick (its B still needs their residuals):
        (ticks, stages)."""
        backward = self.backward[..., 0] != IDLE
        started = np.cumsum(self.forward[..., 0] != IDLE, axis=0)
        return started - (np.cumsum(backward, axis=0) - backward)


def theoretical_bubble(stages: int, microbatches: int, virtual: int = 1) -> float:
    return (stages - 1) / (virtual * microbatches + stages - 1)


# Cached: the run planner (angel_jax/plan.py) costs thousands of layouts on a few schedules. Its
# tables are read-only, so no caller changes another's.
@functools.cache
def make_schedule(name: str, stages: int, microbatches: int, virtual: int = 1) -> Schedule:
    """The tick table of schedule `name`. Stage s's n-th work item (n < v m) is microbatch
    (n // (v p)) p + n % p on its chunk (n // p) % v: microbatches go in groups of p, each group
    around the ring v times (for v = 1, item n is microbatch n)."""
    p, m, v = stages, microbatches, virtual
    if name not in SCHEDULES:
        raise ConfigError(f"config.pipeline.schedule={name!r}: use one of {', '.join(SCHEDULES)}")
    if v > 1 and name == "gpipe":
        raise ConfigError(
            f"config.pipeline.virtual_stages={v} needs config.pipeline.schedule=1f1b or "
            f"circular (here {name}); or set virtual_stages=1"
        )
    if v > 1 and m % p:
        raise ConfigError(
            f"config.pipeline.microbatches={m} is not divisible by config.mesh.pipeline={p}: "
            "virtual stages send microbatches round the ring in groups of p"
        )
    items = v * m
    n = np.arange(items)
    mb = (n // (v * p)) * p + n % p
    chunk = (n // p) % v
    s = np.arange(p)[:, None]
    f_tick = n[None, :] + s
    if name == "1f1b":
        # A group's B items run its chunks in reverse; each hop back takes a tick, and the
        # last stage runs the last chunk's B in the tick of its F: item n's B is the stage's
        # n_b-th, at tick n_b + (v + 1) p - 2 - s (for v = 1, n + 2(p - 1) - s).
        n_b = (n // (v * p)) * (v * p) + (v - 1 - chunk) * p + n % p
        b_tick = n_b[None, :] + (v + 1) * p - 2 - s
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
    forward.flags.writeable = backward.flags.writeable = False
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


class Residuals:
    """Splits the vjp functions of one traced function into the residuals it computed, kept in
    slot buffers from a microbatch's F to its B, and those that are its weights (found by
    identity), which B passes in again rather than every kept microbatch holding a copy."""

    def __init__(self):
        self.treedef = None  # Of the first trace's vjp: its backward applies to any trace's.
        self.sources = None  # Per residual: the index of the weight it is, or -1 (saved).
        self.avals = None  # Every residual's shape and dtype, the same in every trace.

    def save(self, vjp: Callable, weights) -> list[jax.Array]:
        leaves, treedef = jax.tree.flatten(vjp)
        index = {id(w): i for i, w in enumerate(jax.tree.leaves(weights))}
        sources = tuple(index.get(id(leaf), -1) for leaf in leaves)
        avals = tuple((leaf.shape, leaf.dtype) for leaf in leaves)
        if self.sources is None:
            self.treedef, self.sources, self.avals = treedef, sources, avals
        elif (sources, avals) != (self.sources, self.avals):
            raise AssertionError(
                f"a stage's residuals changed between traces: {sources} {avals}, first "
                f"{self.sources} {self.avals}"
            )
        return [leaf for leaf, source in zip(leaves, sources, strict=True) if source < 0]

    def restore(self, saved: list[jax.Array], weights) -> Callable:
        weights, saved = jax.tree.leaves(weights), iter(saved)
        leaves = [weights[i] if i >= 0 else next(saved) for i in self.sources]
        return jax.tree.unflatten(self.treedef, leaves)


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
    axes; `grad_specs`: the grads' layouts, like {"layers": ..., **shared}."""
    program = _Program.make(
        schedule, fns, mesh, shared, tokens_MBT, targets_MBT, hidden_spec, grad_specs
    )
    on_stages = P(PIPELINE)
    layer_specs = jax.tree.map(lambda _: on_stages, layers)
    table_spec = P(None, PIPELINE)
    run = jax.shard_map(
        program.stage,
        mesh=mesh,
        in_specs=(layer_specs, on_stages, P(), P(), P(), table_spec, table_spec, P()),
        out_specs=(P(), layer_specs, P()),
        axis_names=set(mesh.axis_names) if program.fully_manual else {PIPELINE},
        check_vma=False,
    )
    with sharding.no_rules() if program.fully_manual else contextlib.nullcontext():
        return run(
            layers,
            jnp.asarray(layout.mask()),
            shared,
            tokens_MBT,
            targets_MBT,
            jnp.asarray(schedule.forward),
            jnp.asarray(schedule.backward),
            jnp.asarray(schedule.busy_ticks()),
        )


def _zeros(tree, dtype=None):
    return jax.tree.map(lambda x: jnp.zeros(x.shape, dtype or x.dtype), tree)


@dataclasses.dataclass(frozen=True)
class _Program:
    """What every stage's program shares: the shapes, the layouts it pins, how it skips work,
    the forward of a layer and of the head under `jax.vjp`, and the residuals they keep. Each
    `lax.cond`'s branches give their outputs the same layout (XLA requires it)."""

    schedule: Schedule
    fns: StageFunctions
    h_shape: jax.ShapeDtypeStruct  # One microbatch's hidden states (B, T, D).
    values_shape: dict  # The objective and the head's metrics.
    mesh: Mesh
    hidden_spec: P
    layer_grad_specs: object  # Inside the stage region: (chunk, slot, ...), `pipeline` left out.
    shared_grad_specs: dict
    # Manual over the pipeline axis only, unless it is the mesh's one split axis: then manual
    # over all (cuDNN attention's custom partitioner fails in a partly manual region), with
    # nothing left to lay out inside.
    fully_manual: bool
    # Ring attention's ppermutes (over `context`) sit inside the layers, and a collective that
    # only some stages reach hangs: XLA's collective-permute spans every device. With `context`
    # split, a tick's F (B) phase runs on every stage when any stage has an F (a B), an idle
    # stage on stale inputs with its results dropped, and every padded layer slot runs (zero
    # weights: an exact identity, with zero grads); the predicates are then the same on every
    # device.
    uniform: bool
    # Saved residuals: found on the first trace, reused by every later one.
    layer_residuals: Residuals
    head_residuals: Residuals

    @classmethod
    def make(cls, schedule, fns, mesh, shared, tokens_MBT, targets_MBT, hidden_spec, grad_specs):
        h_shape = jax.eval_shape(fns.embed, shared, tokens_MBT[0])
        _, metrics_shape = jax.eval_shape(fns.head_loss, shared, h_shape, targets_MBT[0])
        return cls(
            schedule,
            fns,
            h_shape,
            {"objective": jax.ShapeDtypeStruct((), jnp.float32), **metrics_shape},
            mesh,
            hidden_spec,
            jax.tree.map(
                lambda spec: P(None, None, *spec[1:]),
                grad_specs["layers"],
                is_leaf=lambda x: isinstance(x, P),
            ),
            {name: spec for name, spec in grad_specs.items() if name != "layers"},
            {a for a in mesh.axis_names if mesh.shape[a] > 1} <= {PIPELINE},
            mesh.shape[CONTEXT] > 1,
            Residuals(),
            Residuals(),
        )

    def pin(self, x, spec=None):
        if self.fully_manual:
            return x
        sharded = jax.sharding.NamedSharding(
            shard_map_mesh(self.mesh), self.hidden_spec if spec is None else spec
        )
        return jax.lax.with_sharding_constraint(x, sharded)

    def pin_grads(self, grads, shared_grads):
        return (
            jax.tree.map(self.pin, grads, self.layer_grad_specs),
            jax.tree.map(self.pin, shared_grads, self.shared_grad_specs),
        )

    def h_zeros(self):
        return self.pin(jnp.zeros(self.h_shape.shape, self.h_shape.dtype))

    def maybe(self, pred, run, skip, *operands, anywhere=None):
        """`lax.cond(pred, run, skip, *operands)`; with `uniform`, on `anywhere` (a predicate
        the same on every stage: run, then drop what `pred` would skip) or, with none, `run`."""
        if not self.uniform:
            return jax.lax.cond(pred, run, skip, *operands)
        if anywhere is None:
            return run(*operands)
        return jax.lax.cond(anywhere, run, skip, *operands)

    def layer_forward(self, params, h):
        h, vjp = jax.vjp(lambda params, h: self.pin(self.fns.layer(params, h)), params, self.pin(h))
        return h, self.layer_residuals.save(vjp, params)

    def head_forward(self, shared, h, targets):
        # Under `nothing_saveable`, the residuals are the head's input and the targets: a B
        # recomputes the logits rather than every kept microbatch holding them (B x T x V).
        head = jax.checkpoint(self.fns.head_loss, policy=jax.checkpoint_policies.nothing_saveable)
        objective, vjp, metrics = jax.vjp(
            lambda shared, h: head(shared, h, targets), shared, h, has_aux=True
        )
        return objective, metrics, self.head_residuals.save(vjp, shared)

    def stage(self, layers, mask, shared, tokens, targets, forward_table, backward_table, busy):
        """One stage's part (inside the shard_map): every tick of the schedule, then the
        metrics and the grads."""
        v, m = self.schedule.virtual, self.schedule.microbatches
        # (v x slots, ...) on this stage -> (v, slots, ...): its chunks.
        layers = jax.tree.map(lambda x: x.reshape(v, -1, *x.shape[1:]), layers)
        on = _OnStage(self, jax.lax.axis_index(PIPELINE), layers, mask, shared, tokens, targets)
        kept = jax.tree.map(lambda x: jnp.zeros((self.schedule.slots, *x.shape), x.dtype), on.kept)
        grads = self.pin_grads(_zeros(layers, jnp.float32), _zeros(shared, jnp.float32))
        carry = (self.h_zeros(), self.h_zeros(), kept, *grads, _zeros(self.values_shape))
        carry, _ = jax.lax.scan(
            functools.partial(_tick, on), carry, (forward_table, backward_table, busy)
        )
        _, _, _, grads, shared_grads, sums = carry
        # Only the first stage has embedding grads, only the last head grads and metrics.
        shared_grads, sums = jax.lax.psum((shared_grads, sums), PIPELINE)
        grads = jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), grads)
        return jax.tree.map(lambda x: x / m, sums), grads, shared_grads


def _pick(tree, i):
    return jax.tree.map(lambda x: x[i], tree)


class _OnStage:
    """One stage's chunks and inputs inside the stage region: a chunk's forward and backward
    (`_tick` runs them by the schedule)."""

    def __init__(self, program: _Program, s, layers, mask, shared, tokens, targets):
        self.program, self.s, self.layers, self.mask = program, s, layers, mask
        self.shared, self.tokens, self.targets = shared, tokens, targets
        h_shape = program.h_shape
        self.layer_saved = jax.eval_shape(
            program.layer_forward, _pick(_pick(layers, 0), 0), h_shape
        )[1]
        self.head_saved = jax.eval_shape(program.head_forward, shared, h_shape, targets[0])[2]
        # What a slot keeps: each layer slot's residuals, and the head's.
        self.kept = (
            jax.tree.map(
                lambda x: jax.ShapeDtypeStruct((mask.shape[1], *x.shape), x.dtype),
                self.layer_saved,
            ),
            self.head_saved,
        )

    def is_first(self, chunk):
        return (self.s == 0) & (chunk == 0)

    @property
    def slots(self):
        return jnp.arange(self.mask.shape[1])

    def layer(self, chunk, slot):
        """One layer slot's weights, indexed in the layer loop: a chunk's weights picked whole
        would be a float32 copy of them."""
        return jax.tree.map(lambda x: x[chunk, slot], self.layers)

    def is_last(self, chunk):
        schedule = self.program.schedule
        return (self.s == schedule.stages - 1) & (chunk == schedule.virtual - 1)

    def chunk_forward(self, chunk, mb, x):
        """The chunk's output, the residuals its B needs, objective and metrics (on the last
        chunk, else zero)."""
        g, shared = self.program, self.shared
        h = jax.lax.cond(
            self.is_first(chunk),
            lambda: g.pin(g.fns.embed(shared, self.tokens[mb])),
            lambda: g.pin(x),
        )

        def body(h, xs):
            slot, present = xs
            skip = lambda params, h: (h, _zeros(self.layer_saved))
            return g.maybe(present, g.layer_forward, skip, self.layer(chunk, slot), h)

        h, saved = jax.lax.scan(body, h, (self.slots, self.mask[chunk]))
        no_head = lambda: (
            jnp.zeros((), jnp.float32),
            _zeros({k: x for k, x in g.values_shape.items() if k != "objective"}),
            _zeros(self.head_saved),
        )
        objective, metrics, saved_head = jax.lax.cond(
            self.is_last(chunk), lambda: g.head_forward(shared, h, self.targets[mb]), no_head
        )
        return h, (saved, saved_head), {"objective": objective, **metrics}

    def chunk_backward(self, chunk, mb, saved, g_out, grads, keep):
        """(`grads` with the chunk's layers' grads added, of `shared`, of its input) from its
        residuals; `keep` masks a grad before it is added. Each layer's grads go straight
        into the accumulators: a chunk's stacked grads would be a float32 copy of its layers."""
        g, shared = self.program, self.shared
        saved_layers, saved_head = saved

        def head():
            vjp = g.head_residuals.restore(saved_head, shared)
            d_shared, d_h = vjp(jnp.full((), 1.0 / g.schedule.microbatches, jnp.float32))
            return d_shared, g.pin(d_h.astype(g.h_shape.dtype))  # Mean over microbatches.

        no_head = lambda: (_zeros(shared), g.pin(g_out))
        d_shared, d_h = jax.lax.cond(self.is_last(chunk), head, no_head)

        def body(carry, xs):
            d_h, grads = carry
            slot, saved, present = xs
            params = self.layer(chunk, slot)

            def layer_backward(params, saved, d_h):
                d_params, d_h = g.layer_residuals.restore(saved, params)(d_h)
                return g.pin(d_h), d_params

            skip = lambda params, saved, d_h: (d_h, _zeros(params))
            d_h, d_params = g.maybe(present, layer_backward, skip, params, saved, d_h)
            add = lambda acc, d: acc.at[chunk, slot].add(keep(d))
            return (d_h, jax.tree.map(add, grads, d_params)), None

        xs = (self.slots, saved_layers, self.mask[chunk])
        (d_h, grads), _ = jax.lax.scan(body, (d_h, grads), xs, reverse=True)

        def embed():
            _, vjp = jax.vjp(lambda shared: g.fns.embed(shared, self.tokens[mb]), shared)
            return jax.tree.map(jnp.add, d_shared, vjp(d_h)[0]), g.h_zeros()

        d_shared, d_x = jax.lax.cond(self.is_first(chunk), embed, lambda: (d_shared, d_h))
        return grads, d_shared, d_x


def _tick(on: _OnStage, carry, rows):
    """One tick of the schedule on a stage (the `lax.scan` body): its F phase, then its B phase.
    `rows`: this stage's rows of the forward and backward tables, and the busy ticks' row."""
    recv_f, recv_b, kept, grads, shared_grads, sums = carry
    (mb, chunk, slot), (b_mb, b_chunk, b_slot) = rows[0][0], rows[1][0]
    any_f, any_b = rows[2]  # Whether any stage has an F, a B, at this tick.
    recv_f, kept, sums = _forward_phase(on, (mb, chunk, slot), any_f, recv_f, kept, sums)
    recv_b, grads, shared_grads = _backward_phase(
        on, (b_mb, b_chunk, b_slot), any_b, recv_b, kept, grads, shared_grads
    )
    return (recv_f, recv_b, kept, grads, shared_grads, sums), None


def _forward_phase(on: _OnStage, work, any_f, recv_f, kept, sums):
    """F: run the chunk, keep its residuals in the slot, send the output on. `work`: the
    (microbatch, chunk, slot) of this stage's F, microbatch IDLE for none."""
    g, p = on.program, on.program.schedule.stages
    mb, chunk, slot = work
    active = mb != IDLE
    mb, chunk, slot = (jnp.maximum(x, 0) for x in (mb, chunk, slot))
    idle = lambda: (g.h_zeros(), _zeros(on.kept), _zeros(g.values_shape))
    run = lambda: on.chunk_forward(chunk, mb, recv_f)
    out, saved, values = g.maybe(active, run, idle, anywhere=any_f)
    kept = jax.tree.map(
        lambda buf, x: buf.at[slot].set(jnp.where(active, x, buf[slot])), kept, saved
    )
    sums = jax.tree.map(lambda acc, x: acc + jnp.where(active, x, 0), sums, values)
    recv_f = g.pin(jax.lax.ppermute(out, PIPELINE, [(i, (i + 1) % p) for i in range(p)]))
    return recv_f, kept, sums


def _backward_phase(on: _OnStage, work, any_b, recv_b, kept, grads, shared_grads):
    """B: the chunk's backward from its kept residuals; add its grads, send the input's.
    `work`: the (microbatch, chunk, slot) of this stage's B, microbatch IDLE for none."""
    g, p = on.program, on.program.schedule.stages
    b_mb, b_chunk, b_slot = work
    b_active = b_mb != IDLE
    b_mb, b_chunk, b_slot = (jnp.maximum(x, 0) for x in (b_mb, b_chunk, b_slot))
    keep = lambda grad: jnp.where(b_active, grad, 0).astype(jnp.float32)

    def backward(grads, shared_grads):
        grads, d_shared, d_x = on.chunk_backward(
            b_chunk, b_mb, _pick(kept, b_slot), recv_b, grads, keep
        )
        shared_grads = jax.tree.map(lambda acc, d: acc + keep(d), shared_grads, d_shared)
        d_x = jnp.where(b_active, d_x, 0).astype(recv_b.dtype)
        return g.pin(d_x), *g.pin_grads(grads, shared_grads)

    def no_backward(grads, shared_grads):
        return g.h_zeros(), *g.pin_grads(grads, shared_grads)

    d_x, grads, shared_grads = g.maybe(
        b_active, backward, no_backward, grads, shared_grads, anywhere=any_b
    )
    recv_b = g.pin(jax.lax.ppermute(d_x, PIPELINE, [(i, (i - 1) % p) for i in range(p)]))
    return recv_b, grads, shared_grads
