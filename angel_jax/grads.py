"""The gradients of a batch, in the ZeRO grad layout: in one pass, summed over microbatches,
through the pipeline's schedule, or per data-parallel replica and averaged by PowerSGD.
Streamed layers' grads stay in host memory (`GradLayout.constrain`). Under LoRA only the
adapters are differentiated: the frozen base weights get no grads at all."""

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from angel_jax import lora, sharding
from angel_jax.family import Pieces
from angel_jax.losses import TrainingLoss, cross_entropy
from angel_jax.offload.programs import Space, fetch_f32
from angel_jax.offload.stream import layer_chunks, pipelined, regroup
from angel_jax.optim.powersgd import PowerSGD
from angel_jax.parallel.pipeline import StageFunctions, pipeline_grads
from angel_jax.planning.stage_plan import PipelinePlan


@dataclasses.dataclass(frozen=True, eq=False)
class PipelineSetup:
    """What the pipeline's schedule needs beside the loss: the plan, the family's pieces and
    its config (the stage layer and the head's loss are applied piece by piece)."""

    plan: PipelinePlan
    microbatches: int
    pieces: Pieces
    model_config: Any
    z_loss: float


@dataclasses.dataclass(frozen=True, eq=False)
class GradSetup:
    """The layout the grads are made in (`train.build` fills it from the plan)."""

    mesh: Mesh
    microbatches: int  # config.train.microbatches: accumulated in float32 when > 1.
    grad_sharding: Any  # The ZeRO grad layout (a prefix of the grads' tree).
    abstract_params: Any  # The params the grads are of: the compute copy where there is one.
    stacked: Any  # Per weight: whether it is the layers' stack.
    streams_params: bool  # Stacked weights' compute copy and grads live in host memory.
    chunks_in_flight: int  # Streamed layers' sums moved at a time.
    pipeline: PipelineSetup | None = None
    powersgd: PowerSGD | None = None
    powersgd_start_step: int = 0
    comm_sharding: Any = None  # The PowerSGD state's shardings.
    # LoRA: the grads are the adapters' alone (`lora.adapters` of the params), and
    # `grad_sharding`, `abstract_params` and `stacked` are theirs.
    adapters_only: bool = False
    # LoRA dropout's keys come from this seed, the step and the microbatch; None: no dropout.
    dropout_seed: int | None = None


class Gradients:
    """The grads of `loss` in the layout `setup` says."""

    def __init__(self, loss: TrainingLoss, setup: GradSetup):
        self.loss, self.setup = loss, setup
        self.layout = GradLayout(setup)

    def loss_and_grads(self, params, batch_BT1: jax.Array, step: jax.Array | None = None):
        """Mean loss, metrics and grads over the batch (at `step`: LoRA dropout's keys).
        Grads come in the params' dtype, or float32 when accumulated over microbatches;
        streamed layers' grads in host memory (stacked, or one array per layer when
        accumulated)."""
        if self.setup.pipeline:
            metrics, grads = _pipeline_grads(self.loss, self.setup, params, batch_BT1)
            return metrics, self.constrain(grads)
        micro = self.setup.microbatches
        keys = self._dropout_keys(step)
        if micro == 1:
            with lora.dropout_key(None if keys is None else keys[0]):
                (_, metrics), grads = self._grad_fn(params, batch_BT1)
            return metrics, self.constrain(grads)
        add = lambda acc, xs: (self._add_microbatch(params, xs[0], acc, xs[1]), None)
        micro_MBT = self.microbatches(batch_BT1)
        sums = self.zero_sums(params, micro_MBT[0])
        (metrics, grads), _ = jax.lax.scan(add, sums, (micro_MBT, keys))
        return self.mean_metrics(metrics), grads

    def _dropout_keys(self, step):
        """One LoRA dropout key a microbatch at `step`, or None (no dropout)."""
        seed = self.setup.dropout_seed
        if seed is None or step is None:
            return None
        key = jax.random.fold_in(jax.random.key(seed), step)
        return jax.random.split(key, self.setup.microbatches)

    @property
    def _grad_fn(self):
        if not self.setup.adapters_only:
            return jax.value_and_grad(self.loss, has_aux=True)

        def adapters_grad(params, batch):
            # The base weights enter as constants: no cotangent is made for them.
            loss = lambda adapters, b: self.loss(lora.with_adapters(params, adapters), b)
            return jax.value_and_grad(loss, has_aux=True)(lora.adapters(params), batch)

        return adapters_grad

    def microbatches(self, batch_BT1: jax.Array) -> jax.Array:
        """The batch as [microbatches, rows / microbatches, length]: microbatch j takes rows j,
        j + microbatches, ... (each device keeps its own rows)."""
        micro = self.setup.microbatches
        rows, length = batch_BT1.shape
        return batch_BT1.reshape(rows // micro, micro, length).swapaxes(0, 1)

    def zero_sums(self, params, mb):
        """(metrics, grads) sums before the first microbatch (`params` and `mb`, a microbatch,
        as arrays or shapes): zeros, the grads in float32."""
        shapes = jax.eval_shape(lambda p, b: self.loss(p, b)[1], params, mb)
        return jax.tree.map(lambda m: jnp.zeros(m.shape, m.dtype), shapes), self.layout.zeros()

    def _add_microbatch(self, params, mb, sums, dropout_key=None):
        """`sums` (metrics, float32 grads) with microbatch `mb`'s, its grads over the number
        of microbatches."""
        with lora.dropout_key(dropout_key):
            (_, metrics), grads = self._grad_fn(params, mb)
        acc_metrics, acc_grads = sums
        scale = 1.0 / self.setup.microbatches
        grads = self.layout.accumulate(acc_grads, self.constrain(grads), scale)
        return jax.tree.map(jnp.add, acc_metrics, metrics), grads

    def add_microbatch(self, params, batch_BT1: jax.Array, j: jax.Array, sums):
        """`sums` with microbatch j's of the batch (as `microbatches` splits it): the body of
        `loss_and_grads`' loop as a program of its own, for a step dispatched a microbatch at
        a time (`steps.OffloadedStep`)."""
        mb = jax.lax.dynamic_index_in_dim(self.microbatches(batch_BT1), j, keepdims=False)
        return self._add_microbatch(params, mb, sums)

    def mean_metrics(self, metrics):
        """Summed microbatch metrics as the batch's means."""
        return jax.tree.map(lambda m: m / self.setup.microbatches, metrics)

    @property
    def streamed(self):
        """Like `setup.stacked`: the weights whose compute copy and grads live in host memory."""
        return self.layout.streamed

    def constrain(self, grads):
        """Grads (or their float32 sums) in the ZeRO grad layout (`GradLayout.constrain`)."""
        return self.layout.constrain(grads)

    def powersgd(self, state, batch_BT1: jax.Array):
        """(metrics, grads, new PowerSGD state): each replica's grads on its rows of the batch,
        averaged through PowerSGD (`_powersgd_grads`)."""
        return _powersgd_grads(self._grad_fn, self.setup, state, batch_BT1)


class GradLayout:
    """Where grads and their float32 sums live, apart from the loss they are of: the ZeRO
    grad layout on the device, streamed layers' in host memory."""

    def __init__(self, setup: GradSetup):
        self.setup = setup

    @functools.cached_property
    def streamed(self):
        """Like `setup.stacked`: the weights whose compute copy and grads live in host memory."""
        return jax.tree.map(lambda s: s and self.setup.streams_params, self.setup.stacked)

    def constrain(self, grads):
        """Grads (or their float32 sums) in the ZeRO grad layout; streamed layers' are left
        where they are, in host memory in their params' layout (and per layer when summed)."""
        # The shardings' tree is a prefix of `grads`, whose summed streamed leaves are tuples.
        return jax.tree.map(
            lambda s, host, g: g if host else jax.lax.with_sharding_constraint(g, s),
            self.setup.grad_sharding,
            self.streamed,
            grads,
        )

    def zeros(self):
        """Float32 zeros to accumulate grads into; a streamed weight's one per layer on host."""

        def zeros(p, host):
            if not host:
                return jnp.zeros(p.shape, jnp.float32)
            layer = jnp.zeros(p.shape[1:], jnp.float32)
            return tuple(jax.device_put(layer, Space.Host) for _ in range(p.shape[0]))

        return self.constrain(jax.tree.map(zeros, self.setup.abstract_params, self.streamed))

    def accumulate(self, acc, grads, scale: float):
        """acc + scale * grads in float32; streamed layers' sums stay in host memory, a layer
        at a time on the device."""
        if not self.setup.streams_params:
            return self.constrain(
                jax.tree.map(lambda a, g: a + g.astype(jnp.float32) * scale, acc, grads)
            )
        chunks, layers, treedef = layer_chunks(grads, acc, stacked=self.setup.stacked)
        dest = [Space.Host if n else Space.Device for n in layers for _ in range(n or 1)]

        def add(k, g, a):
            return (jax.device_put(fetch_f32(a) + fetch_f32(g) * scale, dest[k]),)

        done = pipelined(add, [c[1:] for c in chunks], self.setup.chunks_in_flight)
        return self.constrain(regroup(done, layers, treedef)[0])


def _pipeline_grads(loss: TrainingLoss, setup: GradSetup, params, batch_BT1: jax.Array):
    """`Gradients.loss_and_grads` through the pipeline's schedule, microbatch j taking rows j,
    j + m, ... (float32 grads, not yet in the grad layout)."""
    pipe = setup.pipeline
    inputs_BT, targets_BT = loss.inputs_and_targets(batch_BT1)
    m = pipe.microbatches
    micro = lambda x_BT: x_BT.reshape(x_BT.shape[0] // m, m, -1).swapaxes(0, 1)
    cfg, z_loss, pieces = pipe.model_config, pipe.z_loss, pipe.pieces

    def head_loss(shared, h_BTD, targets_BT):
        h_BTD = pieces.final_norm(cfg, shared, h_BTD)
        logits = pieces.lm_head(cfg, shared)(h_BTD).astype(jnp.float32)
        logits = sharding.constrain(logits, ("batch", "length", "vocab"))
        return cross_entropy(logits, targets_BT, z_loss)

    fns = StageFunctions(
        functools.partial(pieces.embed, cfg), functools.partial(pieces.layer, cfg), head_loss
    )
    shared = {name: p for name, p in params.items() if name != "layers"}
    metrics, layer_grads, shared_grads = pipeline_grads(
        pipe.plan.schedule,
        pipe.plan.layout,
        fns,
        setup.mesh,
        params["layers"],
        shared,
        micro(inputs_BT),
        micro(targets_BT),
        sharding.active_spec(("batch", "norm_length", "embed")),
        jax.tree.map(lambda s: s.spec, setup.grad_sharding),
    )
    metrics.pop("objective")
    return metrics, {**shared_grads, "layers": layer_grads}


def _powersgd_grads(grad_fn, setup: GradSetup, state, batch_BT1: jax.Array):
    """(metrics, grads, new PowerSGD state): each replica's grads (`grad_fn`'s) on its rows of
    the batch (the mesh has no other split axis), averaged through PowerSGD's low-rank
    factors instead of XLA's all-reduce; exactly before `train.powersgd_start_step` (early
    grads are the least low-rank, as PyTorch's PowerSGD hook also assumes)."""
    start, powersgd, stacked = setup.powersgd_start_step, setup.powersgd, setup.stacked

    def per_replica(step, params, comm, batch):
        with sharding.no_rules():
            (_, metrics), grads = grad_fn(params, batch)
        compressed = lambda: powersgd.average(grads, comm, stacked)
        exact = lambda: (jax.lax.pmean(grads, "data"), comm)
        grads, comm = jax.lax.cond(step >= start, compressed, exact)
        return jax.lax.pmean(metrics, "data"), grads, comm

    comm_specs = jax.tree.map(lambda s: s.spec, setup.comm_sharding)
    return jax.shard_map(
        per_replica,
        mesh=setup.mesh,
        in_specs=(P(), P(), comm_specs, P("data")),
        out_specs=(P(), P(), comm_specs),
        check_vma=False,
    )(state.step, state.params, state.comm, batch_BT1)
