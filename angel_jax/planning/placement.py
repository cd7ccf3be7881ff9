"""The ZeRO-Cache placement: `make_plan` places each model state on the device, in pinned host
memory or on SSD, per config.offload.policy (the policies and states: `plan.py`), trying the
candidates fastest first and refusing, before anything is allocated, a run that fits nowhere.
"""

import dataclasses
import math

import jax
import numpy as np

from angel_jax import lora
from angel_jax.config import ACTIVATION_TIERS, ConfigError, choose
from angel_jax.planning import activations, tiers
from angel_jax.planning.chunks import (
    hybrid_share,
    may_update_between_microbatches,
    on_disk_bytes,
    pool_arrays,
    update_chunks,
    weight_sizes,
    with_cpu_update,
    with_resident,
    with_step_chunks,
)
from angel_jax.planning.groups import in_flight_bytes
from angel_jax.planning.inputs import PlanInput
from angel_jax.planning.memory import splits_masters, zero_splits
from angel_jax.planning.plan import POLICIES, Plan, local_bytes
from angel_jax.planning.tiers import DEVICE, HOST, SSD, USABLE


def _split_bytes(abstract_params, stacked, dtype=None) -> tuple[int, int]:
    """Bytes per device of (the stacked layer weights, the rest)."""
    leaves = zip(jax.tree.leaves(abstract_params), jax.tree.leaves(stacked), strict=True)
    layers = sum(local_bytes(p, dtype) for p, s in leaves if s)
    return layers, local_bytes(abstract_params, dtype) - layers


# The states each policy keeps in pinned host memory (the layer inputs too where the plan
# puts them there).
HOST_STATES = {
    "none": ("offloaded activations",),
    "optimizer": ("offloaded activations", "master params", "optimizer state"),
}
HOST_STATES["params"] = HOST_STATES["optimizer"] + (
    "streamed params",
    "streamed grads",
    "delayed streamed grads",
)


def _splits_masters(inp: PlanInput, name: str) -> bool:
    """Whether offload policy `name`'s tiers hold the masters' low halves
    (config.offload.split_masters)."""
    split = inp.offload.split_masters and splits_masters(np.dtype(inp.model.dtype))
    return split and name == "optimizer"  # The compute copy on the device.


class _UpdateChunks:
    """The update's chunks (a trained weight, or a layer's slice of a stacked one: its master
    and optimizer state) and where a candidate puts them: beside the step, in the device's
    spare room, on SSD, in the host cores' share, in the pinned-host pool."""

    def __init__(
        self,
        inp: PlanInput,
        trained_params,
        grads,
        masters,
        opt,
        trained_stacked,
        *,
        pipelined: bool,
    ):
        o = inp.offload
        self.inp, self.pipelined = inp, pipelined
        self.masters, self.opt, self.trained_stacked = masters, opt, trained_stacked
        # In the update's order; with the masters split (`Plan.split_masters`), their tier holds
        # the low half.
        chunk_lists = {False: update_chunks(masters, opt, trained_stacked)}
        chunk_lists[True] = [(key, m // 2, s) for key, m, s in chunk_lists[False]]
        self.by_split = chunk_lists
        disk_bytes = on_disk_bytes if o.ssd_compress else local_bytes
        on_disk = update_chunks(masters, opt, trained_stacked, disk_bytes)
        self.state_on_disk = {key: s for key, _, s in on_disk}
        self.in_flight, self.in_step = o.chunks_in_flight, o.update_in_step
        self.speculative = self.in_step and o.speculative_update
        # A speculating step keeps a resident chunk's old copy too.
        self.kept = 2 if self.speculative else 1
        # A delayed update may run between the next step's microbatches (`Plan.slot_bytes`).
        self.weight_bytes = weight_sizes(
            trained_params, grads, trained_stacked, np.dtype(inp.model.dtype)
        )

    def step_chunks(self, plan: Plan) -> Plan:
        """`plan` with the update's groups beside the step or between the next step's
        microbatches (`with_step_chunks`) as its chunks now lie."""
        between = may_update_between_microbatches(self.inp, plan, self.pipelined)
        slots = self.inp.train.microbatches - 1 if between else 0
        chunks = self.by_split[plan.split_masters]
        return with_step_chunks(
            plan, chunks, self.in_flight, self.in_step, self.speculative, slots, self.weight_bytes
        )

    def filled(self, plan: Plan) -> Plan:
        """`plan` with the device's spare room filled with update chunks, in the update's
        order; once more when the groups beside the step, as chunks became resident, shrank."""
        chunks = self.by_split[plan.split_masters]
        kept = self.kept
        for _ in range(2):
            spare = USABLE * self.inp.budget[DEVICE] - plan.tier_bytes(DEVICE)
            resident = set(plan.resident)
            for key, master, state in chunks:
                if key not in resident and kept * (master + state) <= spare:
                    spare -= kept * (master + state)
                    resident.add(key)
            filled = self.step_chunks(with_resident(plan, resident, chunks))
            if plan.resident and plan.copies_beside_step and not filled.copies_beside_step:
                break  # The second fill would push the groups beside the step out.
            plan = filled
        return plan

    def on_ssd(self, plan: Plan) -> Plan:
        """`plan` with what host memory cannot hold on disk, from the last chunks of the
        update back."""
        chunks = self.by_split[plan.split_masters]
        state_bytes, placement = plan.state_bytes, plan.placement
        over = plan.tier_bytes(HOST) - USABLE * self.inp.budget[HOST]
        on_ssd, on_disk = set(), 0
        for key, master, state in reversed(chunks):
            if over <= 0:
                break
            if key not in plan.resident:
                on_ssd.add(key)
                over -= master + state
                state_bytes["master params"] -= master
                state_bytes["optimizer state"] -= state
                on_disk += master + self.state_on_disk[key]
        state_bytes["SSD chunks"] = on_disk
        placement["SSD chunks"] = SSD
        # SSD groups go alone: the groups beside the step as they will be.
        return self.step_chunks(dataclasses.replace(plan, on_ssd=frozenset(on_ssd)))

    def with_cpu_share(self, plan: Plan, measure_rates) -> Plan:
        """`plan` with the host cores' share of its host-memory chunks
        (config.offload.cpu_update; -1: from `measure_rates()`)."""
        inp = self.inp
        chunks = self.by_split[plan.split_masters]
        host = [c for c in chunks if c[0] not in plan.resident | plan.on_ssd]
        share, note = inp.offload.cpu_update, ""
        if share < 0 and inp.processes > 1:
            share, note = 0.0, "cpu_update=-1 picked 0 (the hybrid update is one process's)"
        elif share < 0:
            share, note = hybrid_share(
                measure_rates(), host, np.dtype(inp.model.dtype).itemsize, plan.split_masters
            )
        plan = self.step_chunks(with_cpu_update(plan, share, host, plan.split_masters))
        if note:
            plan = dataclasses.replace(
                plan, cpu_note="; ".join(filter(None, (plan.cpu_note, note)))
            )
        return plan

    def pool(self, plan: Plan) -> tiers.PoolArrays:
        """What `plan` allocates in XLA's pinned-host pool (`pool_arrays`)."""
        chunks = self.by_split[plan.split_masters]
        return pool_arrays(self.inp, plan, chunks, self.masters, self.opt, self.trained_stacked)


class _StateSizes:
    """Each state's bytes per device under an offload policy and a remat policy, from the
    abstract states and each remat policy's activations: what every candidate starts from."""

    def __init__(
        self,
        inp: PlanInput,
        params,
        grads,
        masters,
        opt,
        stacked,
        trained_stacked,
        *,
        extra,
        pipeline,
        chunks: _UpdateChunks,
    ):
        self.inp, self.chunks = inp, chunks
        self.params, self.grads, self.masters, self.opt = params, grads, masters, opt
        self.stacked, self.trained_stacked = stacked, trained_stacked
        self.compute_dtype = np.dtype(inp.model.dtype)
        self.extra = extra or {}
        if pipeline is not None:
            self.remats = (pipeline.remat,)
            none = dict.fromkeys(("layer inputs", "offloaded activations"), 0)
            self.activations = {
                pipeline.remat: {**none, "activations": int(pipeline.activation_bytes)}
            }
        else:
            self.remats = activations.remat_choices(inp)
            self.activations = {r: activations.activation_bytes(inp, r) for r in self.remats}
        self.accumulating = inp.train.microbatches > 1

    def for_policy(self, name: str, remat: str) -> dict[str, int]:
        """State -> bytes per device under offload policy `name` and `remat`."""
        params, grads, accumulating = self.params, self.grads, self.accumulating
        saved = dict(self.activations[remat])
        saved["activations"] += self.extra.get((name != "none", remat), 0)
        if name == "none":  # float32 masters are the compute params; float32 grads.
            return {
                "compute params": local_bytes(params),
                "grads": local_bytes(grads),
                **({"microbatch grads": local_bytes(grads)} if accumulating else {}),
                "optimizer state": local_bytes(self.opt),
                **saved,
            }
        # Grads come in the compute dtype, or as their float32 sum when accumulating; then
        # each microbatch's, in the compute dtype, live in the step's temporaries.
        grad_bytes = self.compute_dtype.itemsize / 4
        layer_params, other_params = _split_bytes(params, self.stacked, self.compute_dtype)
        f32_grads = _split_bytes(grads, self.trained_stacked)
        layer_grads, other_grads = (b if accumulating else int(b * grad_bytes) for b in f32_grads)
        split = _splits_masters(self.inp, name)
        out = {
            "compute params": layer_params + other_params,
            "grads": layer_grads + other_grads,
            "master params": local_bytes(self.masters) // (2 if split else 1),
            "optimizer state": local_bytes(self.opt),
            **saved,
        }
        if not self.chunks.in_step:  # Else the update runs inside the step: "chunks in the step".
            out["update chunks"] = in_flight_bytes(
                self.chunks.by_split[split], self.chunks.in_flight
            )
        if accumulating:
            out["microbatch grads"] = int(sum(f32_grads) * grad_bytes)
        if name == "params":
            out.update(self._streamed(layer_params, other_params, other_grads))
            if accumulating:  # The streamed layers' pass through "layers in flight".
                out["microbatch grads"] = int(f32_grads[1] * grad_bytes)
        if self.inp.offload.delayed_update:  # The waiting step's grads beside the next step's:
            # in the compute dtype, or their float32 sum when accumulating.
            waiting = (4 if accumulating else self.compute_dtype.itemsize) / 4
            layer_waiting, other_waiting = (int(b * waiting) for b in f32_grads)
            streamed = name == "params"
            out["delayed grads"] = other_waiting + (0 if streamed else layer_waiting)
            if streamed:
                out["delayed streamed grads"] = layer_waiting
        return out

    def _streamed(self, layer_params: int, other_params: int, other_grads: int) -> dict[str, int]:
        """Policy params' states: layer weights and grads (in the params' layout: grads return
        the way weights came) move to the host; two layers at a time visit the device,
        gathered."""
        inp = self.inp
        f32_sum = layer_params * 4 // self.compute_dtype.itemsize if self.accumulating else 0
        gathered = inp.zero_ranks if zero_splits("params", inp.zero_stage) else 1
        return {
            "compute params": other_params,
            "grads": other_grads,
            "streamed params": layer_params,
            "streamed grads": layer_params + f32_sum,
            # Weights, grads and a prefetch of each of two layers.
            "layers in flight": 2 * 3 * layer_params * gathered // max(inp.model.num_layers, 1),
        }


class _Placer:
    """Makes `make_plan`'s candidates, one per offload policy, remat policy and layer inputs'
    tier, from the states' sizes (`_StateSizes`) and the update's chunks (`_UpdateChunks`)."""

    def __init__(
        self, inp: PlanInput, params, grads, offloaded_masters, opt, stacked, extra, pipeline
    ):
        self.inp = inp
        # The trained weights (LoRA: the adapters), which alone have grads, masters to update
        # and optimizer state: `grads`, `offloaded_masters` and `opt` are theirs.
        trained = lora.adapters if inp.model.lora_rank else lambda tree: tree
        trained_stacked = trained(stacked)
        self.chunks = _UpdateChunks(
            inp,
            trained(params),
            grads,
            offloaded_masters,
            opt,
            trained_stacked,
            pipelined=pipeline is not None,
        )
        self.sizes = _StateSizes(
            inp,
            params,
            grads,
            offloaded_masters,
            opt,
            stacked,
            trained_stacked,
            extra=extra,
            pipeline=pipeline,
            chunks=self.chunks,
        )
        self.num_params = sum(math.prod(p.shape) for p in jax.tree.leaves(params))
        # One backward pass through layers not scanned (`Plan.grads_after_activations`).
        accumulating = inp.train.microbatches > 1
        self.unrolled = not (inp.model.scan_layers or accumulating or pipeline is not None)

    def placed(self, name: str, remat: str, inputs: str) -> Plan:
        """The candidate of offload policy `name`, `remat` and the layer inputs' tier
        `inputs`; under policy auto with the device's spare room filled with update chunks,
        and what host memory cannot hold on SSD."""
        state_bytes = self.sizes.for_policy(name, remat)
        on_host = HOST_STATES[name] + (("layer inputs",) if inputs == HOST else ())
        placement = {s: HOST if s in on_host else DEVICE for s in state_bytes}
        plan = Plan(
            name,
            remat,
            placement,
            state_bytes,
            self.inp.budget,
            self.num_params,
            self.inp.devices,
            split_masters=_splits_masters(self.inp, name),
            grads_after_activations=name == "none" and self.unrolled,
        )
        # With every chunk in host memory: the room the groups beside the step may take.
        plan = self.chunks.step_chunks(plan)
        if self.inp.offload.policy != "auto" or name == "none":
            return plan
        plan = self.chunks.filled(plan)
        if SSD not in self.inp.budget or name != "optimizer":  # Layer streaming keeps no SSD tier.
            return plan
        return self.chunks.on_ssd(plan)

    def finished(self, plan: Plan, measure_rates) -> Plan:
        """A fitting offloading candidate with the host cores' share of the update
        (config.offload.cpu_update; -1: from `measure_rates()`) and its pinned-host pool
        checked."""
        inp, policy = self.inp, self.inp.offload.policy
        plan = self.chunks.with_cpu_share(plan, measure_rates)
        plan = dataclasses.replace(plan, pool=self.chunks.pool(plan))
        overflow = tiers.pool_overflow(plan, inp.local_devices)
        if overflow:
            raise ConfigError(f"config.offload.policy={policy}: {overflow}")
        return dataclasses.replace(plan, pool_note=tiers.pool_note(plan, inp.local_devices))


def make_plan(
    inp: PlanInput,
    *,
    params,
    grads,
    offloaded_masters,
    opt,
    stacked,
    inputs_offloadable: bool,
    measure_rates=None,
    extra_activations: dict[tuple[bool, str], int] | None = None,
    pipeline=None,
) -> Plan:
    """Places each state per config.offload.policy; raises ConfigError if it cannot fit, or
    if the plan does not have what the offload settings need (`check_settings`).

    `params`, `grads`, `offloaded_masters` are the abstract params in those states' layouts
    (with shardings), `opt` the abstract optimizer state, `stacked` which weights are stacked;
    under LoRA (`inp.model.lora_rank`) grads, masters and optimizer state are the adapters'
    alone (`lora.adapters`), so the plan counts them for the trained params only;
    `inputs_offloadable`: the model's layers can keep their inputs in host memory;
    `measure_rates`: () -> the rates `hybrid_share` takes (`cpu.measure_rates`), called when
    config.offload.cpu_update is -1 and the plan offloads the optimizer;
    `extra_activations`: (whether the plan offloads the optimizer, remat policy) -> bytes
    that compiled step's temporaries took beyond the activation estimate
    (`CompiledTooLarge.beyond_estimate`), added to it; `pipeline`: the stages' plan
    (`stage_plan.PipelinePlan`), whose remat pick and activations (the residuals of its
    microbatches in flight, per stage) stand in for `remat_choices` and `activation_bytes`,
    which count a batch through every layer at once.
    """
    o = inp.offload
    choose("offload.policy", o.policy, POLICIES)
    choose("offload.activations", o.activations, ACTIVATION_TIERS)
    placer = _Placer(
        inp, params, grads, offloaded_masters, opt, stacked, extra_activations, pipeline
    )
    remats = placer.sizes.remats
    names = ("none", "optimizer", "params") if o.policy == "auto" else (o.policy,)
    # The layer inputs' tiers to try, device first: their copies cost less than any other
    # state's offload (one (tokens, d_model) array per layer each way, overlapped with compute).
    inputs = {"device": (DEVICE,), "host": (HOST,), "auto": (DEVICE, HOST)}[o.activations]
    if not inputs_offloadable and o.activations == "host":
        raise ConfigError(
            "config.offload.activations=host needs remat and layers that name their input "
            "(a Llama model outside a pipeline): use offload.activations=auto or device"
        )
    if o.policy == "params" and remats == ("none",):
        raise ConfigError(
            "config.offload.policy=params streams layer weights inside remat: set "
            "config.model.remat (e.g. full, dots_no_batch or auto), not none"
        )
    # Offload policies first (the layer inputs' copies cost less than an update's of the
    # optimizer state), then the inputs' tier and remat together (`inputs_and_remats`).
    candidates = [
        placer.placed(n, r, tier)
        for n in names
        for tier, r in activations.inputs_and_remats(inp, inputs, remats)
        if not (r == "none" and n == "params")  # Layer streaming runs inside remat.
        if tier == DEVICE or (r != "none" and inputs_offloadable)
    ]
    plan = next((p for p in candidates if p.fits()), None)
    if plan is None:
        raise _refusal(placer, candidates, inputs, inputs_offloadable)
    if plan.offloads_optimizer:
        plan = placer.finished(plan, measure_rates)
    check_settings(inp, plan)
    return plan


def _refusal(placer: _Placer, candidates, inputs, inputs_offloadable: bool) -> ConfigError:
    """Why no candidate fits, and the settings that would help."""
    inp, remats = placer.inp, placer.sizes.remats
    policy, budget = inp.offload.policy, inp.budget
    plan = candidates[-1]
    need = ", ".join(
        f"{t} {plan.tier_bytes(t) / 2**30:.1f} GiB of {USABLE * plan.budget[t] / 2**30:.1f} usable"
        for t in plan.budget
    )
    short = {t for t in plan.budget if plan.tier_bytes(t) > USABLE * plan.budget[t]}
    # Where the host tier is short, and is all that is for an offloading plan: the pinned-host
    # pool's settings that hold the first such plan.
    fits = lambda p: all(p.tier_bytes(t) <= USABLE * p.budget[t] for t in p.budget if t != HOST)
    held = next((p for p in candidates if p.offloads_optimizer and fits(p)), None)
    setting = ""
    if HOST in short and held:
        pool = placer.chunks.pool(held)
        setting = tiers.pool_advice(dataclasses.replace(held, pool=pool), inp.local_devices)
    fixes = [*tiers.pool_fixes(short, setting=setting), tiers.more_devices()]
    if inp.zero_stage < 3:
        fixes += ["ZeRO-3 (config.zero_stage=3)"]
    fixes += ["gradient accumulation (config.train.microbatches)", "a smaller model or batch"]
    if plan.remat != "full":
        fixes += ["more remat (config.model.remat=auto or full)"]
    if HOST not in inputs and inputs_offloadable and remats != ("none",):
        fixes += ["config.offload.activations=auto or host"]
    if policy != "auto":
        fixes += ["config.offload.policy=auto"]
    if SSD not in budget:
        fixes += ["an SSD tier (config.offload.ssd_dir, with policy auto)"]
    return ConfigError(
        f"config.offload.policy={policy}: the model states do not fit ({need} per device); "
        f"use {', '.join(fixes[:-1])} or {fixes[-1]}"
    )


def check_settings(inp: PlanInput, plan: Plan) -> None:
    """Refuses offload settings that `plan` (or the run) does not have what they need for,
    each with its setting."""
    o = inp.offload
    if o.delayed_update and not plan.offloads_optimizer:
        raise ConfigError(
            "config.offload.delayed_update=true delays the offloaded optimizer update, and "
            f"the plan's policy ({plan.policy}) keeps the optimizer on the device: set "
            "config.offload.policy=optimizer or params, or delayed_update=false"
        )
    if o.update_in_step:
        _check_update_in_step(inp, plan)
    if o.speculative_update and not (inp.train.grad_clip > 0 or inp.train.on_anomaly == "skip"):
        raise ConfigError(
            "config.offload.speculative_update=true speculates past clipping and the anomaly "
            "guard, and this run has neither (config.train.grad_clip=0, "
            f"config.monitor.on_anomaly={inp.train.on_anomaly}): the update in the step "
            "waits for nothing already; set speculative_update=false"
        )
    if o.speculative_update and not o.update_in_step:
        raise ConfigError(
            "config.offload.speculative_update=true speculates the update inside the step: "
            "set config.offload.update_in_step=true too, or speculative_update=false"
        )


def _check_update_in_step(inp: PlanInput, plan: Plan) -> None:
    """config.offload.update_in_step's needs, each with its setting."""
    needs = []
    if not plan.offloads_optimizer or plan.streams_params:
        needs.append(
            f"the optimizer offloaded without layer streaming (the plan's policy is "
            f"{plan.policy}): config.offload.policy=optimizer"
        )
    if inp.model.scan_layers:
        needs.append("the layers unrolled: config.model.scan_layers=false")
    if not inp.has_pieces:
        needs.append(f"a decoder family with unrolled layers (not {inp.model.family})")
    if inp.offload.delayed_update:
        needs.append("this step's grads: config.offload.delayed_update=false")
    if plan.on_ssd or plan.on_cpu:
        needs.append(
            'every chunk on the device or in pinned host memory: config.offload.ssd_dir="" '
            "and config.offload.cpu_update=0"
        )
    if needs:
        raise ConfigError("config.offload.update_in_step=true needs " + "; ".join(needs))
