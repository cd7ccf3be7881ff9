"""ZeRO-Cache placement planner: which memory tier holds each model state.

States, per device (after ZeRO and tensor sharding):
  compute params  (model dtype, for forward/backward; the fp32 masters when not offloaded)
  master params   (float32; their low 16 bits beside a bfloat16 compute copy on the device:
                   config.offload.split_masters, offload/masters.py)
  grads           (float32; their sum when accumulating microbatches)
  microbatch grads (accumulating: one microbatch's grads, held in the step's temporaries)
  optimizer state (AdamW: mu + nu, float32; mu in bfloat16 with config.train.mu_dtype)
  layer inputs    (the residual stream entering each layer: what every remat policy keeps
                   for the backward pass, exact; config.offload.activations: on the device,
                   in pinned host memory, or auto: the device if the plan fits, else the host)
  activations     (the rest, an estimate from the remat policy; on the device, or offloaded
                   to pinned host memory by the `offload_dots` remat policy)
config.model.remat=auto: the fastest remat policy (remat.AUTO_REMATS, in their order) with
which the policy's plan fits, tried for each offload policy (none first) and layer inputs'
tier (the device first) in turn.
Each state lives in exactly one tier. Policies:
  none       everything on the device (the fp32 masters are also the compute params);
  optimizer  master params + optimizer state in pinned host memory, a compute-dtype copy of the
             params on the device; the update streams them through the device one chunk (a
             layer's slice of one weight) at a time; grads in the compute dtype (float32 while
             accumulating microbatches);
  params     also the layers' compute-dtype weights and their grads in pinned host memory: the
             scan over layers copies each layer's weights to the device as it needs them, in
             the forward and again in the backward pass, and each layer's grads leave the
             device as the backward pass makes them;
  auto       the first of none, optimizer, params that fits, with the device filled first:
             update chunks (a layer's slice of a weight: its master and optimizer state) stay
             on the device while it has room, the rest go to host memory, and what host
             memory cannot hold goes to the SSD tier (config.offload.ssd_dir), where the
             optimizer state may be kept in bfloat16 (config.offload.ssd_compress).
Hybrid update (config.offload.cpu_update): a share of the host-memory chunks is kept in plain
host memory and updated by the host's cores while the device updates the rest.
A plan that fits nowhere is refused before anything is allocated.
The tiers' budgets are measured in `tiers`, the update's groups made in `groups`.
"""

import collections
import dataclasses
import math

import jax
import ml_collections
import numpy as np

from angel_jax import machine
from angel_jax.config import ACTIVATION_TIERS, ConfigError, choose, head_dim
from angel_jax.kernels import resolve_attention
from angel_jax.memory import per_device_widths, saved_values, zero_splits
from angel_jax.mesh import CONTEXT, DATA, EXPERT, SEQUENCE, TENSOR
from angel_jax.offload import masters, tiers
from angel_jax.offload.groups import (
    beside_step_groups,
    chunk_part,
    flight,
    group_chunks,
    in_flight_bytes,
    new_compute_bytes,
    slot_order,
    slot_size,
)
from angel_jax.offload.tiers import CPU, DEVICE, HOST, SSD, USABLE
from angel_jax.parallel.stage_plan import layer_flops
from angel_jax.remat import REMATS, auto_order, has_attention_results, kept, recomputed

POLICIES = ("none", "optimizer", "params", "auto")
ACTIVATIONS = ("layer inputs", "activations", "offloaded activations")
# States alive only during the jitted forward/backward, and only during the streamed update
# that runs after it: a tier holds the larger of the two at a time, not both (on an H200 the
# 8B step peaked at 80 GiB where their sum planned 105).
# "chunks in the step": the update's chunks in flight when it runs inside the step
# (config.offload.update_in_step); "old ... state kept": the state it keeps for a redo when it
# speculates (config.offload.speculative_update).
STEP_ONLY = (
    *ACTIVATIONS,
    "microbatch grads",
    "layers in flight",
    "chunks beside the step",
    "chunks in the step",
    "old state kept",
    "old device state kept",
)
# The step's states that XLA holds as the compiled step's temporaries (on the device).
IN_TEMPORARIES = ("layer inputs", "activations", "microbatch grads", "chunks in the step")
UPDATE_ONLY = ("update chunks",)
# A recomputing layer's backward temporaries per token, in (d_model, ffn_dim) values.
WORKING_WIDTHS = (8, 6)


@dataclasses.dataclass(frozen=True)
class Plan:
    policy: str  # The policy in force (auto resolved).
    remat: str  # The remat policy whose activations it holds (config.model.remat, auto resolved).
    placement: dict[str, str]  # State -> tier.
    state_bytes: dict[str, int]  # State -> bytes per device.
    budget: dict[str, int]  # Tier -> bytes per device.
    num_params: int
    num_devices: int
    # Update chunks, (weight path as jax.tree_util.keystr, layer or None), whose master and
    # optimizer state stay on the device under an offloading policy.
    resident: frozenset = frozenset()
    on_ssd: frozenset = frozenset()  # Update chunks whose master and state live on disk.
    on_cpu: frozenset = frozenset()  # Update chunks the host's cores update (hybrid update).
    cpu_note: str = ""  # The hybrid update's share, for the plan's table.
    # The update's first groups are fetched before the step and its last ones go home beside
    # the next step (`StreamedUpdate.prefetch`); off when the device has no room for them
    # beside the step's activations: the update then ends with its copies home.
    copies_beside_step: bool = True
    # A delayed update (config.offload.delayed_update) that runs between the next step's
    # microbatches: the bytes of each of its groups, one dispatched after each microbatch
    # but the last, with one group fetched and one on its way home beside each microbatch
    # ("chunks beside the step"), and its new compute copy made beside the one they read
    # ("new compute params"); chunks larger than a slot run after the last microbatch
    # (`slot_order`). 0: the update runs after the step (no delay, no microbatches, layer
    # streaming, a pipeline, the update inside the step, no chunk moved, or no room beside
    # the microbatches for slots that take most of the moved bytes).
    slot_bytes: int = 0
    # The offloaded masters' tiers hold their low halves, the compute copy on the device their
    # high halves (config.offload.split_masters, a bfloat16 compute copy, `offload/masters.py`);
    # the host's cores' chunks keep theirs whole.
    split_masters: bool = False
    # The grads come after the step's activations: the policy none's step (one program, its
    # grads among its temporaries) over unrolled layers and no microbatches makes each
    # layer's grads in the backward pass as it frees that layer's saved values, and the
    # update takes them once all are freed (in moe_1b's step compiled for the H200 the
    # temporaries peak at the backward's start, with no grad made yet). A scan's backward
    # allocates its stacked grads at its start, beside every saved value; microbatches keep
    # their grads' sum beside each microbatch's activations.
    grads_after_activations: bool = False
    # What it allocates in XLA's pinned-host pool, in order (`tiers.replay_pool`), and the
    # plan table's line on that pool's setting (on a GPU).
    pool: tiers.PoolArrays | None = None
    pool_note: str = ""

    @property
    def update_between_microbatches(self) -> bool:
        return self.slot_bytes > 0

    def chunk_tier(self, path: str, layer: int | None) -> str:
        if (path, layer) in self.on_ssd:
            return SSD
        if (path, layer) in self.on_cpu:
            return CPU
        return DEVICE if (path, layer) in self.resident else HOST

    def fits(self) -> bool:
        return all(self.tier_bytes(t) <= USABLE * self.budget[t] for t in self.budget)

    @property
    def offloads_optimizer(self) -> bool:
        return self.policy != "none"

    @property
    def streams_params(self) -> bool:
        return self.policy == "params"

    @property
    def layer_inputs_on_host(self) -> bool:
        return self.placement.get("layer inputs") == HOST

    def tier_bytes(self, tier: str) -> int:
        """Peak bytes per device in `tier`: the lasting states, and the larger of what the step
        and what the streamed update hold for a while (or the grads made after the step's
        activations, `grads_after_activations`)."""
        held = {s: b for s, b in self.state_bytes.items() if self.placement[s] == tier}
        step = sum(held.pop(s, 0) for s in STEP_ONLY)
        update = sum(held.pop(s, 0) for s in UPDATE_ONLY)
        if self.grads_after_activations:
            update += held.pop("grads", 0)
        return sum(held.values()) + max(step, update)

    def bytes_per_param(self) -> float:
        """Device + host memory of the model states (not activations), over all devices, per
        trained parameter: AngelPTM's density measure (17.3 for ZeRO-Cache)."""
        b = self.state_bytes
        # The update's chunks on the device at their most: beside the step, or in the update.
        in_flight = ("chunks beside the step", "update chunks", "chunks in the step")
        transient = max(b.get(s, 0) for s in in_flight)
        states = transient + sum(
            nbytes
            for s, nbytes in b.items()
            if s not in (*ACTIVATIONS, *in_flight) and self.placement[s] != SSD
        )
        return states * self.num_devices / self.num_params

    def table(self) -> str:
        gib = lambda b: f"{b / 2**30:8.2f}"
        lines = [f"ZeRO-Cache plan (policy {self.policy}, remat {self.remat}), GiB per device:"]
        lines.append(f"  {'state':<22} {'tier':<12} {'GiB':>8}")
        for state, nbytes in self.state_bytes.items():
            lines.append(f"  {state:<22} {self.placement[state]:<12} {gib(nbytes)}")
        for tier in self.budget:
            used, budget = self.tier_bytes(tier), self.budget[tier]
            lines.append(f"  {'peak ' + tier:<35} {gib(used)} of {gib(budget).strip()} budget")
        if "update chunks" in self.state_bytes:
            lines.append(
                "  (a peak counts the step's activations and microbatch grads, with the "
                "update's groups beside them, or the update's chunks, the larger)"
            )
        if self.offloads_optimizer and not self.copies_beside_step:
            lines.append(
                "  no room beside the step for the update's groups: the update waits for its "
                "copies home, and fetches none before the step"
            )
        if self.grads_after_activations:
            lines.append(
                "  (the unrolled layers' grads are made as their activations are freed: a "
                "peak counts the step's activations or the grads, the larger)"
            )
        lines.append(f"  model states: {self.bytes_per_param():.1f} bytes per parameter")
        if self.cpu_note:
            lines.append(f"  hybrid update: {self.cpu_note}")
        if self.pool_note:
            lines.append(f"  pinned-host pool: {self.pool_note}")
        return "\n".join(lines)


def local_bytes(abstract_tree, dtype=None) -> int:
    total = 0
    for x in jax.tree.leaves(abstract_tree):
        shape = x.sharding.shard_shape(x.shape)
        total += math.prod(shape) * np.dtype(dtype or x.dtype).itemsize
    return total


def activation_bytes(config: ml_collections.ConfigDict, mesh, remat: str) -> dict[str, int]:
    """Per-device bytes of saved activations under REMATS[remat] (memory.saved_values): "layer
    inputs" (exact: the residual stream entering each layer), "activations" (the rest the
    remat policy keeps on the device, with what one layer's recomputing backward holds and the
    float32 logits and their gradient, one of `logits_chunks` slices at a time) and
    "offloaded activations" (what it keeps in host memory)."""
    m, t = config.model, config.train
    # Batch splits over data and expert, positions over context and sequence.
    splits = math.prod(mesh.shape[a] for a in (DATA, EXPERT, CONTEXT, SEQUENCE))
    tokens = t.batch_size // t.microbatches * t.seq_len / splits
    itemsize, tensor = np.dtype(m.dtype).itemsize, mesh.shape[TENSOR]
    # A token's MLP width: its experts' (routed and shared) in a mixture of experts.
    ffn, routed = m.ffn_dim, 0.0
    if m.num_experts:
        f, k, policy = m.moe_ffn_dim or m.ffn_dim, m.experts_per_token, REMATS[remat]
        ffn = (k + m.shared_experts) * f
        if m.router == "dropless" and any(policy.expert_rows):
            # Beyond the FFN widths of a token's k routed rows: dropless keeps rows for its
            # expert group's assignments (each rank gathers the group's tokens), and their
            # weighted hidden rows and sorted input rows too.
            group, (hidden, inputs) = mesh.shape[EXPERT], policy.expert_rows
            keeps = ((policy.widths[3] + hidden) * f / tensor + inputs * m.d_model) * group
            routed = (keeps - policy.widths[3] * f / tensor) * k
    widths = per_device_widths(
        m.d_model, m.num_heads, m.num_kv_heads, head_dim(m), ffn, tensor, m.sequence_parallel
    )
    xla_keys = 0  # On XLA's attention some policies keep (T, T) arrays per head.
    if resolve_attention(m, machine.backend()) == "xla":
        xla_keys = m.num_heads / (tensor * mesh.shape[SEQUENCE]) * t.seq_len / mesh.shape[CONTEXT]
    on_device, on_host = saved_values(
        kept(remat, keeps_attention_results(config, mesh)), widths, xla_keys, itemsize
    )
    per_value = m.num_layers * tokens * itemsize  # Bytes of one value per token and layer.
    logits = 2 * tokens * m.vocab_size * 4 / tensor / m.logits_chunks
    working = 0
    if remat != "none":
        # One layer's backward holds what it recomputes: about 8 d_model-wide and 6 ffn-wide
        # values per token (with their grads), the latter per MLP slice. Fitted to llama_1b's
        # compiled step at 524k tokens on the H200 (97.1 GiB of temporaries, full remat).
        width = WORKING_WIDTHS[0] * m.d_model + WORKING_WIDTHS[1] * ffn / m.mlp_chunks
        working = tokens * width * itemsize / tensor
    # Unrolled layers: the LM head's backward frees the logits and their gradient before the
    # last layer's backward makes its working set, so the temporaries peak with one or the
    # other beside the saved values (moe_1b's step compiled for the H200 peaks at the
    # backward's start: the saved values and the logits). Scanned layers keep the sum (as
    # fitted): their backward's start allocates the stacked grads beside the saved values.
    transient = working + logits if m.scan_layers else max(working, logits)
    return {
        "layer inputs": int(per_value * widths[0]),
        "activations": int(per_value * (on_device + routed - widths[0]) + transient),
        "offloaded activations": int(per_value * on_host),
    }


def _split_bytes(abstract_params, stacked, dtype=None) -> tuple[int, int]:
    """Bytes per device of (the stacked layer weights, the rest)."""
    leaves = zip(jax.tree.leaves(abstract_params), jax.tree.leaves(stacked), strict=True)
    layers = sum(local_bytes(p, dtype) for p, s in leaves if s)
    return layers, local_bytes(abstract_params, dtype) - layers


def _chunks(
    abstract_params, opt_abstract, stacked, state_bytes=local_bytes
) -> list[tuple[tuple[str, int | None], int, int]]:
    """((weight path, layer or None), master bytes, state bytes) of each update chunk; the
    state's bytes as `state_bytes` counts a parameter's state (`_on_disk`: compressed)."""
    out = []
    for (path, p), leaf_state, is_stacked in zip(
        jax.tree_util.tree_leaves_with_path(abstract_params),
        jax.tree.structure(abstract_params).flatten_up_to(opt_abstract),
        jax.tree.leaves(stacked),
        strict=True,
    ):
        master, state = local_bytes(p), state_bytes(leaf_state)
        key = jax.tree_util.keystr(path)
        if is_stacked:
            n = p.shape[0]
            out += [((key, i), master // n, state // n) for i in range(n)]
        else:
            out.append(((key, None), master, state))
    return out


def weight_sizes(params, grads, stacked, compute_dtype) -> dict[str, tuple[int, int, int]]:
    """`groups.new_compute_bytes`' weight -> (its compute copy's bytes, its chunks: layers if
    stacked, else 1; its float32 grads' bytes), per device, from the abstract `params` and
    `grads` in their layouts."""
    return {
        jax.tree_util.keystr(path): (
            local_bytes(p, compute_dtype),
            p.shape[0] if is_stacked else 1,
            local_bytes(g, np.float32),
        )
        for (path, p), g, is_stacked in zip(
            jax.tree_util.tree_leaves_with_path(params),
            jax.tree.leaves(grads),
            jax.tree.leaves(stacked),
            strict=True,
        )
    }


def _on_disk(state) -> int:
    """An optimizer state's bytes on disk with config.offload.ssd_compress: its float32
    leaves in bfloat16, the others as they are."""
    return sum(
        local_bytes(x) // (2 if x.dtype == np.float32 else 1) for x in jax.tree.leaves(state)
    )


def may_update_between_microbatches(config, plan: Plan, pipelined: bool) -> bool:
    """Whether `plan`'s delayed update (config.offload.delayed_update) may run between the
    next step's microbatches, room allowing (`Plan.slot_bytes`): with microbatches, outside a
    pipeline (`pipelined`), layer streaming and the update inside the step."""
    o = config.offload
    return bool(
        o.delayed_update
        and config.train.microbatches > 1
        and not (pipelined or plan.streams_params or o.update_in_step)
    )


def _with_resident(plan: Plan, resident: set, chunks) -> Plan:
    """`plan` (with none resident yet, or fewer) with update chunks `resident` on the device."""
    state_bytes, placement = dict(plan.state_bytes), dict(plan.placement)
    moved = [(m, s) for key, m, s in chunks if key in resident - plan.resident]
    for name, nbytes in (("master params", 0), ("optimizer state", 1)):
        state_bytes[name] -= sum(x[nbytes] for x in moved)
    state_bytes["resident chunks"] = state_bytes.get("resident chunks", 0) + sum(
        m + s for m, s in moved
    )
    placement["resident chunks"] = DEVICE
    return dataclasses.replace(
        plan, state_bytes=state_bytes, placement=placement, resident=frozenset(resident)
    )


def _with_step_chunks(
    plan: Plan,
    chunks,
    in_flight: int,
    in_step: bool,
    speculative: bool,
    slots: int,
    weight_bytes: dict | None = None,
) -> Plan:
    """`plan` with the update's groups beside the step counted (`groups.beside_step_groups`, for
    its chunks `chunks` in the update's order), or, when the device has no room for them,
    with `copies_beside_step` off. A delayed update that may run between the next step's
    `slots` + 1 microbatches takes groups as large as spreads its moved chunks over the
    slots, or as the room beside the microbatches for two of them beside its new compute copy
    allows (`Plan.slot_bytes`, `groups.new_compute_bytes` with `weight_bytes`); chunks larger than
    that run after the last microbatch, two at a time. Where those would be most of the
    moved bytes it runs after the step, which then holds no new compute copy.
    With the update inside the step (`in_step`, config.offload.update_in_step) its chunks in
    flight instead ("chunks in the step"): at most `in_flight` of the moved ones, counted as
    the largest; speculating (config.offload.speculative_update), the old state the step
    keeps for a redo beside its new state: the moved chunks in host memory, the resident
    ones and the compute copy on the device."""
    if not plan.offloads_optimizer:
        return plan
    updated = [(key, m + s) for key, m, s in chunks if key not in plan.on_cpu]
    chunk_tiers = [plan.chunk_tier(*key) for key, _ in updated]
    sizes = [size for _, size in updated]
    if in_step:  # Held in the step's temporaries, where the compiled step counts them.
        moved = [n for n, t in zip(sizes, chunk_tiers, strict=True) if t != DEVICE]
        moved.sort(reverse=True)
        state_bytes = {**plan.state_bytes, "chunks in the step": sum(moved[:in_flight])}
        placement = {**plan.placement, "chunks in the step": DEVICE}
        if speculative:
            by_tier = collections.Counter()
            for n, t in zip(sizes, chunk_tiers, strict=True):
                by_tier[t] += n
            state_bytes["old state kept"] = by_tier[HOST]
            state_bytes["old device state kept"] = (
                plan.state_bytes["compute params"] + by_tier[DEVICE]
            )
            placement.update({"old state kept": HOST, "old device state kept": DEVICE})
        return dataclasses.replace(plan, state_bytes=state_bytes, placement=placement)
    placement = {**plan.placement, "chunks beside the step": DEVICE}
    moved = [n for n, t in zip(sizes, chunk_tiers, strict=True) if t != DEVICE]
    if slots and moved:
        # The room beside the microbatches, without the update's chunks (or after the step)
        # and its new compute copy.
        held = {**plan.state_bytes, "chunks beside the step": 0, "update chunks": 0}
        held["new compute params"] = 0
        placement["new compute params"] = DEVICE
        without = dataclasses.replace(plan, state_bytes=held, placement=placement)
        room = USABLE * plan.budget[DEVICE] - without.tier_bytes(DEVICE)
        # A group a slot, with a margin for packing whole chunks (`slot_size`), or the largest
        # slot that leaves room for two of them beside the new compute copy their groups make
        # (larger groups make more of it at once); chunks larger than a slot run after the
        # last microbatch.
        weights = [key[0] for key, _ in updated]
        parts = [chunk_part(w) for w in weights]

        def grouped(slot: int):
            """(the update's order, its groups, their new compute copy) for `slot`, or None
            where two slots and the copy leave the room."""
            order = slot_order(sizes, chunk_tiers, slot)
            in_order = ([x[k] for k in order] for x in (sizes, chunk_tiers, parts))
            groups = group_chunks(*in_order, 2, slot)
            new_copy = new_compute_bytes(groups, [weights[k] for k in order], weight_bytes)
            return (order, groups, new_copy) if 2 * slot + new_copy <= room else None

        slot = slot_size(moved, slots)
        found = grouped(slot)
        if not found:  # The copy grows with the slot: the largest slot that fits, if any.
            low, high = 0, slot
            while high - low > 1:
                mid = (low + high) // 2
                at_mid = grouped(mid)
                if at_mid:
                    low, found = mid, at_mid
                else:
                    high = mid
            slot = low
        if slot:
            order, groups, new_copy = found
            moved_bytes = lambda ks: sum(
                sizes[order[i]] for i in ks if chunk_tiers[order[i]] != DEVICE
            )
            group_bytes = [moved_bytes(ks) for ks in groups]
            # After the last microbatch: the groups past the slots, and those larger than one.
            beside = min(sum(n <= slot for n in group_bytes), slots)
            after = sum(group_bytes[beside:])
        # Taken when it hides most of the update; else the room goes to resident chunks.
        if slot and 2 * after < sum(moved):
            # After the microbatches two groups at a time, the larger ones among them.
            pairs = [a + b for a, b in zip(group_bytes, group_bytes[1:], strict=False)]
            flight_bytes = {
                "chunks beside the step": 2 * slot,
                "update chunks": max([2 * slot, *pairs]),
            }
            return dataclasses.replace(
                plan,
                state_bytes={**held, **flight_bytes, "new compute params": new_copy},
                placement=placement,
                copies_beside_step=True,
                slot_bytes=slot,
            )
    state_bytes = {s: b for s, b in plan.state_bytes.items() if s != "new compute params"}
    if plan.slot_bytes:  # The update after the step: its chunks as `in_flight` has them.
        state_bytes["update chunks"] = in_flight_bytes(chunks, in_flight)
    plan = dataclasses.replace(plan, state_bytes=state_bytes, slot_bytes=0)
    parts = [chunk_part(key[0]) for key, _ in updated]
    groups = group_chunks(sizes, chunk_tiers, parts, in_flight)
    fetched, leaving = beside_step_groups(chunk_tiers, groups, in_flight)
    beside = sum(sizes[k] for g in {*fetched, *leaving} for k in groups[g])
    state_bytes = {**plan.state_bytes, "chunks beside the step": beside}
    with_them = dataclasses.replace(
        plan, state_bytes=state_bytes, placement=placement, copies_beside_step=True
    )
    if with_them.tier_bytes(DEVICE) <= USABLE * plan.budget[DEVICE] or not beside:
        return with_them
    state_bytes["chunks beside the step"] = 0
    return dataclasses.replace(with_them, state_bytes=state_bytes, copies_beside_step=False)


def pool_arrays(config, plan: Plan, chunks, offloaded_masters, opt, stacked) -> tiers.PoolArrays:
    """What `plan` allocates in XLA's pinned-host pool (`tiers.PoolArrays`): its host chunks'
    arrays in the state's initialisation's order, the streamed update's groups as
    `StreamedUpdate` makes them from `chunks` (`_chunks`', in the plan's masters' bytes), and
    the plan's other pinned-host states, each as one array (the host cores' chunks live in
    plain memory). Arguments as `make_plan`'s."""
    in_pool, index = [], {}  # Per host chunk, in tree order: its arrays; key -> its index.
    for (path, p), state, is_stacked in zip(
        jax.tree_util.tree_leaves_with_path(offloaded_masters),
        jax.tree.structure(offloaded_masters).flatten_up_to(opt),
        jax.tree.leaves(stacked),
        strict=True,
    ):
        n, key = p.shape[0] if is_stacked else 1, jax.tree_util.keystr(path)
        master = local_bytes(p) // n // (2 if plan.split_masters else 1)
        # A chunk's scalars (step counts) stay on the device (`stream.home_kind`).
        moments = [local_bytes(x) // n for x in jax.tree.leaves(state) if x.ndim > is_stacked]
        for layer in range(n) if is_stacked else [None]:
            if plan.chunk_tier(key, layer) == HOST:
                index[key, layer] = len(in_pool)
                in_pool.append((master, *moments))
    # The update's chunks, groups and order as `StreamedUpdate` has them.
    updated = [(key, m + s) for key, m, s in chunks if key not in plan.on_cpu]
    sizes = [size for _, size in updated]
    chunk_tiers = [plan.chunk_tier(*key) for key, _ in updated]
    in_flight = 2 if plan.slot_bytes else config.offload.chunks_in_flight
    order = list(range(len(updated)))
    if plan.slot_bytes:
        order = slot_order(sizes, chunk_tiers, plan.slot_bytes)
    in_order = ([x[k] for k in order] for x in (sizes, chunk_tiers, updated))
    sizes, chunk_tiers, updated = in_order
    parts = [chunk_part(key[0]) for key, _ in updated]
    groups = []
    for ks in group_chunks(sizes, chunk_tiers, parts, in_flight, plan.slot_bytes):
        host = tuple(index[updated[k][0]] for k in ks if updated[k][0] in index)
        if host or chunk_tiers[ks[0]] == SSD:  # SSD groups wait on their way home too.
            groups.append(host)
    ahead, leaving = flight(in_flight)
    beside = plan.copies_beside_step and not config.offload.update_in_step
    chunk_states = ("master params", "optimizer state", "CPU-updated chunks")
    on_host = [
        s
        for s, t in plan.placement.items()
        if t == HOST and plan.state_bytes[s] and s not in chunk_states
    ]
    return tiers.PoolArrays(
        chunks=tuple(in_pool),
        groups=None if config.offload.update_in_step else tuple(groups),
        in_flight=in_flight,
        ahead=ahead,
        left_home=(1 if plan.slot_bytes else leaving) if beside else 0,
        old_first=bool(plan.slot_bytes),
        lasting=tuple(plan.state_bytes[s] for s in on_host if s not in STEP_ONLY),
        per_step=tuple(plan.state_bytes[s] for s in on_host if s in STEP_ONLY),
        steps=config.train.steps,
    )


def make_plan(
    config: ml_collections.ConfigDict,
    mesh,
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
    """Places each state per `config.offload.policy`; raises ConfigError if it cannot fit.

    `params`, `grads`, `offloaded_masters` are the abstract params in those states' layouts
    (with shardings), `opt` the abstract optimizer state, `stacked` which weights are stacked;
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
    policy = config.offload.policy
    choose("offload.policy", policy, POLICIES)
    choose("offload.activations", config.offload.activations, ACTIVATION_TIERS)
    budget = tiers.measured_budget(config, mesh)
    compute_dtype = np.dtype(config.model.dtype)
    num_params = sum(math.prod(p.shape) for p in jax.tree.leaves(params))
    extra = extra_activations or {}
    if pipeline is not None:
        remats = (pipeline.remat,)
        none = dict.fromkeys(("layer inputs", "offloaded activations"), 0)
        activations = {pipeline.remat: {**none, "activations": int(pipeline.activation_bytes)}}
    else:
        remats = remat_choices(config, mesh)
        activations = {r: activation_bytes(config, mesh, r) for r in remats}
    accumulating = config.train.microbatches > 1
    # One backward pass through layers not scanned (`Plan.grads_after_activations`).
    unrolled = not (config.model.scan_layers or accumulating or pipeline is not None)
    layers = config.model.num_layers
    # In the update's order; with the masters split (`Plan.split_masters`), their tier holds
    # the low half.
    split = config.offload.split_masters and masters.splits(compute_dtype)
    chunk_lists = {False: _chunks(offloaded_masters, opt, stacked)}
    chunk_lists[True] = [(key, m // 2, s) for key, m, s in chunk_lists[False]]
    disk_bytes = _on_disk if config.offload.ssd_compress else local_bytes
    state_on_disk = {key: s for key, _, s in _chunks(offloaded_masters, opt, stacked, disk_bytes)}
    split_for = lambda name: split and name == "optimizer"  # The compute copy on the device.
    in_flight = config.offload.chunks_in_flight
    in_step = config.offload.update_in_step
    speculative = in_step and config.offload.speculative_update
    kept = 2 if speculative else 1  # A speculating step keeps a resident chunk's old copy too.

    # A delayed update may run between the next step's microbatches (`Plan.slot_bytes`).

    weight_bytes = weight_sizes(params, grads, stacked, compute_dtype)

    def step_chunks(plan: Plan) -> Plan:
        between = may_update_between_microbatches(config, plan, pipeline is not None)
        slots = config.train.microbatches - 1 if between else 0
        chunks = chunk_lists[plan.split_masters]
        return _with_step_chunks(plan, chunks, in_flight, in_step, speculative, slots, weight_bytes)

    def sizes(name: str, remat: str) -> dict[str, int]:
        saved = dict(activations[remat])
        saved["activations"] += extra.get((name != "none", remat), 0)
        if name == "none":  # float32 masters are the compute params; float32 grads.
            return {
                "compute params": local_bytes(params),
                "grads": local_bytes(grads),
                **({"microbatch grads": local_bytes(grads)} if accumulating else {}),
                "optimizer state": local_bytes(opt),
                **saved,
            }
        # Grads come in the compute dtype, or as their float32 sum when accumulating; then
        # each microbatch's, in the compute dtype, live in the step's temporaries.
        grad_bytes = compute_dtype.itemsize / 4
        layer_params, other_params = _split_bytes(params, stacked, compute_dtype)
        f32_grads = _split_bytes(grads, stacked)
        layer_grads, other_grads = (b if accumulating else int(b * grad_bytes) for b in f32_grads)
        out = {
            "compute params": layer_params + other_params,
            "grads": layer_grads + other_grads,
            "master params": local_bytes(offloaded_masters) // (2 if split_for(name) else 1),
            "optimizer state": local_bytes(opt),
            **saved,
        }
        if not in_step:  # Else the update runs inside the step: "chunks in the step".
            out["update chunks"] = in_flight_bytes(chunk_lists[split_for(name)], in_flight)
        if accumulating:
            out["microbatch grads"] = int(sum(f32_grads) * grad_bytes)
        if name == "params":
            # Layer weights and grads (in the params' layout: grads return the way weights
            # came) move to the host; two layers at a time visit the device, gathered.
            f32_sum = layer_params * 4 // compute_dtype.itemsize if accumulating else 0
            gathered = mesh.shape[DATA] if zero_splits("params", config.zero_stage) else 1
            out.update(
                {
                    "compute params": other_params,
                    "grads": other_grads,
                    "streamed params": layer_params,
                    "streamed grads": layer_params + f32_sum,
                    # Weights, grads and a prefetch of each of two layers.
                    "layers in flight": 2 * 3 * layer_params * gathered // max(layers, 1),
                }
            )
            if accumulating:  # The streamed layers' pass through "layers in flight".
                out["microbatch grads"] = int(f32_grads[1] * grad_bytes)
        if config.offload.delayed_update:  # The waiting step's grads beside the next step's:
            # in the compute dtype, or their float32 sum when accumulating.
            waiting = (4 if accumulating else compute_dtype.itemsize) / 4
            layer_waiting, other_waiting = (int(b * waiting) for b in f32_grads)
            streamed = name == "params"
            out["delayed grads"] = other_waiting + (0 if streamed else layer_waiting)
            if streamed:
                out["delayed streamed grads"] = layer_waiting
        return out

    host_states = {
        "none": ("offloaded activations",),
        "optimizer": ("offloaded activations", "master params", "optimizer state"),
    }
    host_states["params"] = host_states["optimizer"] + (
        "streamed params",
        "streamed grads",
        "delayed streamed grads",
    )

    def placed(name: str, remat: str, inputs: str) -> Plan:
        state_bytes = sizes(name, remat)
        on_host = host_states[name] + (("layer inputs",) if inputs == HOST else ())
        placement = {s: HOST if s in on_host else DEVICE for s in state_bytes}
        plan = Plan(
            name,
            remat,
            placement,
            state_bytes,
            budget,
            num_params,
            mesh.size,
            split_masters=split_for(name),
            grads_after_activations=name == "none" and unrolled,
        )
        chunks = chunk_lists[plan.split_masters]
        # With every chunk in host memory: the room the groups beside the step may take.
        plan = step_chunks(plan)
        if policy != "auto" or name == "none":
            return plan
        # Fill the device's spare room with update chunks, in the update's order; once more
        # when the groups beside the step, as chunks became resident, shrank.
        for _ in range(2):
            spare = USABLE * budget[DEVICE] - plan.tier_bytes(DEVICE)
            resident = set(plan.resident)
            for key, master, state in chunks:
                if key not in resident and kept * (master + state) <= spare:
                    spare -= kept * (master + state)
                    resident.add(key)
            filled = step_chunks(_with_resident(plan, resident, chunks))
            if plan.resident and plan.copies_beside_step and not filled.copies_beside_step:
                break  # The second fill would push the groups beside the step out.
            plan = filled
        state_bytes, placement = plan.state_bytes, plan.placement
        if SSD not in budget or name != "optimizer":  # Layer streaming keeps no SSD tier.
            return plan
        # What host memory cannot hold goes to disk, from the last chunks of the update back.
        over = plan.tier_bytes(HOST) - USABLE * budget[HOST]
        on_ssd, on_disk = set(), 0
        for key, master, state in reversed(chunks):
            if over <= 0:
                break
            if key not in plan.resident:
                on_ssd.add(key)
                over -= master + state
                state_bytes["master params"] -= master
                state_bytes["optimizer state"] -= state
                on_disk += master + state_on_disk[key]
        state_bytes["SSD chunks"] = on_disk
        placement["SSD chunks"] = SSD
        # SSD groups go alone: the groups beside the step as they will be.
        return step_chunks(dataclasses.replace(plan, on_ssd=frozenset(on_ssd)))

    names = ("none", "optimizer", "params") if policy == "auto" else (policy,)
    # The layer inputs' tiers to try, device first: their copies cost less than any other
    # state's offload (one (tokens, d_model) array per layer each way, overlapped with compute).
    inputs = {"device": (DEVICE,), "host": (HOST,), "auto": (DEVICE, HOST)}
    inputs = inputs[config.offload.activations]
    if not inputs_offloadable and config.offload.activations == "host":
        raise ConfigError(
            "config.offload.activations=host needs remat and layers that name their input "
            "(a Llama model outside a pipeline): use offload.activations=auto or device"
        )
    if policy == "params" and remats == ("none",):
        raise ConfigError(
            "config.offload.policy=params streams layer weights inside remat: set "
            "config.model.remat (e.g. full, dots_no_batch or auto), not none"
        )
    # Offload policies first (the layer inputs' copies cost less than an update's of the
    # optimizer state), then the inputs' tier and remat together (`inputs_and_remats`).
    candidates = [
        placed(n, r, tier)
        for n in names
        for tier, r in inputs_and_remats(config, inputs, remats)
        if not (r == "none" and n == "params")  # Layer streaming runs inside remat.
        if tier == DEVICE or (r != "none" and inputs_offloadable)
    ]
    for plan in candidates:
        if plan.fits():
            if not plan.offloads_optimizer:
                return plan
            chunks = chunk_lists[plan.split_masters]
            host = [c for c in chunks if c[0] not in plan.resident | plan.on_ssd]
            share, note = config.offload.cpu_update, ""
            if share < 0 and jax.process_count() > 1:
                share, note = 0.0, "cpu_update=-1 picked 0 (the hybrid update is one process's)"
            elif share < 0:
                share, note = hybrid_share(
                    measure_rates(), host, compute_dtype.itemsize, plan.split_masters
                )
            plan = step_chunks(_with_cpu_update(plan, share, host, plan.split_masters))
            if note:
                plan = dataclasses.replace(
                    plan, cpu_note="; ".join(filter(None, (plan.cpu_note, note)))
                )
            local = max(1, mesh.size // jax.process_count())
            pool = pool_arrays(config, plan, chunks, offloaded_masters, opt, stacked)
            plan = dataclasses.replace(plan, pool=pool)
            overflow = tiers.pool_overflow(plan, local)
            if overflow:
                raise ConfigError(f"config.offload.policy={policy}: {overflow}")
            return dataclasses.replace(plan, pool_note=tiers.pool_note(plan, local))
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
        chunks = chunk_lists[held.split_masters]
        pool = pool_arrays(config, held, chunks, offloaded_masters, opt, stacked)
        local = max(1, mesh.size // jax.process_count())
        setting = tiers.pool_advice(dataclasses.replace(held, pool=pool), local)
    fixes = [*tiers.pool_fixes(short, setting=setting), more_devices()]
    if config.zero_stage < 3:
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
    raise ConfigError(
        f"config.offload.policy={policy}: the model states do not fit ({need} per device); "
        f"use {', '.join(fixes[:-1])} or {fixes[-1]}"
    )


def remat_choices(config: ml_collections.ConfigDict, mesh) -> tuple[str, ...]:
    """The remat policies a plan on `mesh` may take: config.model.remat's, or with auto
    remat.AUTO_REMATS fastest first (`remat.auto_order`: by what their backward pass
    recomputes at this sequence length), without dots_attention and attention where there are
    no attention results of cuDNN's or a ring's to keep (there they keep what dots_no_batch
    and full do)."""
    m = config.model
    if m.remat != "auto":
        return (m.remat,)
    return auto_order(keeps_attention_results(config, mesh), *_layer_flops(config))


def _layer_flops(config: ml_collections.ConfigDict) -> tuple[float, float]:
    """(weight matmuls', attention's) forward FLOPs of one of config.model's layers per token
    at config.train.seq_len."""
    from angel_jax.models import make_model  # The models import the trainer's planner.

    return layer_flops(make_model(config.model, machine.backend())[0], config.train.seq_len)


# What a byte of a layer input's copies to host memory and back costs a step, in FLOPs of
# recompute: the H200's matmul rate over its host link's (805 TFLOP/s, 50 GB/s each way),
# doubled for a margin in the device's favour, whose plans leave the pinned pool alone (a
# first step with inputs in host memory paid about 20 s once on the H200). At short context
# the two are even: llama_1b at 48 x 2048, full's recompute over dots_attention's and the
# inputs' copies took 0.22 and 0.20 s a step (remat_auto_llama_1b_attention.json; the rates
# alone say 0.26 and 0.35). At 262,144 tokens attention with the inputs in host memory ran
# 1.26x full on the device, its copies 0.3% of the step
# (long_context_1gpu_262k_attention_host_warm.json, README "Remat attention for long context").
FLOPS_PER_COPIED_BYTE = 2 * 805e12 / 50e9


def inputs_and_remats(config, tiers, remats) -> list[tuple[str, str]]:
    """The (layer inputs' tier, remat) pairs a plan tries, fastest first: with remat auto,
    by the forward FLOPs the backward pass recomputes per token and layer plus, for inputs in
    host memory, their copies' cost (FLOPS_PER_COPIED_BYTE); ties keep the device first. At
    short context the device's tier comes first with every remat; at long context, where the
    attention forward outweighs the copies, attention with its inputs in host memory comes
    before full on the device (llama_1b from about 64k tokens: there 0.27 GFLOP a token and
    layer of causal attention, against 8 KiB of copies, 0.26 GFLOP at that rate)."""
    pairs = [(tier, r) for tier in tiers for r in remats]
    if len(tiers) == 1 or len(remats) == 1:
        return pairs
    flops, m = _layer_flops(config), config.model
    copies = 2 * m.d_model * np.dtype(m.dtype).itemsize * FLOPS_PER_COPIED_BYTE
    cost = lambda pair: recomputed(pair[1], *flops) + (copies if pair[0] == HOST else 0)
    return sorted(pairs, key=cost)


def keeps_attention_results(config: ml_collections.ConfigDict, mesh) -> bool:
    """Whether the attention's forward results are there for a remat policy to keep on
    `mesh`: cuDNN's attention, or a ring (its merged results are named)."""
    attention = resolve_attention(config.model, machine.backend())
    return has_attention_results(attention, mesh.shape[CONTEXT])


def hybrid_share(rates: dict, chunks, compute_bytes: int, split: bool = False) -> tuple[float, str]:
    """(share of the host `chunks`' parameters for the host's cores, the line that says why)
    from measured `rates` (`cpu.measure_rates`; copies in bytes down and the same bytes back
    per second). A parameter updated on the device moves its master and state down and back;
    one updated by the host moves its grad down and its compute copy back, through the same
    link, and costs the host's update. With both running, at the rates measured together, the
    link's time falls and the host's grows with the share: the share where they meet, unless
    that is not 5% faster than the device's update alone at its own rates (then 0). `split`:
    the chunks' masters are their low halves (`Plan.split_masters`)."""
    params = sum(m for _, m, _ in chunks) / (2 if split else 4)
    moved = sum(m + s for _, m, s in chunks) / max(params, 1)  # Bytes each way a parameter.
    g = {name: rate / 1e9 for name, rate in rates.items()}
    measured = (
        f"host update {g['host_params_per_s']:.2f}G params/s, copies "
        f"{g['copy_bytes_per_s']:.1f} GB/s; together {g['host_params_per_s_both']:.2f}G and "
        f"{g['copy_bytes_per_s_both']:.1f} GB/s"
    )
    if min(rates.values()) <= 0:
        return 0.0, f"cpu_update=-1 picked 0 (a rate measured 0: {measured})"
    link, update = rates["copy_bytes_per_s_both"], rates["host_params_per_s_both"]
    share = (moved / link) / (1 / update + moved / link)
    both = share * (1 / update + compute_bytes / link)  # = the link's time at that share.
    alone = moved / rates["copy_bytes_per_s"]
    times = f"{both * 1e9:.2f} s per G params against {alone * 1e9:.2f} s on the device alone"
    if both > 0.95 * alone:
        return 0.0, f"cpu_update=-1 picked 0 (measured {measured}: {share:.0%} would take {times})"
    return share, f"cpu_update=-1 picked {share:.0%} (measured {measured}: {times})"


def _with_cpu_update(plan: Plan, share: float, host, split: bool = False) -> Plan:
    """`plan` with `share` of its host-memory chunks' (`host`) parameters updated by the host's
    cores, spread over the update's order, so that both the host and the device work from its
    start. `split`: `host` counts the masters' low halves (`Plan.split_masters`); the host's
    cores keep theirs whole, as they make the compute copy themselves."""
    if share > 0 and jax.process_count() > 1:
        raise ConfigError(
            f"config.offload.cpu_update={share}: the hybrid update runs in one process only "
            "for now; set it to 0 on multi-process runs"
        )
    total = sum(m for _, m, _ in host)
    on_cpu, taken, seen = set(), 0, 0
    for key, master, _ in host:
        seen += master
        if taken + master / 2 <= share * seen:  # Behind the share: the host takes this one.
            on_cpu.add(key)
            taken += master
    if not on_cpu:
        return plan
    state_bytes, placement = dict(plan.state_bytes), dict(plan.placement)
    cpu = {"master params": 0, "optimizer state": 0}
    for key, master, state in host:
        if key in on_cpu:
            cpu["master params"] += master
            cpu["optimizer state"] += state
    for name, nbytes in cpu.items():
        state_bytes[name] -= nbytes
    state_bytes["CPU-updated chunks"] = sum(cpu.values()) + (cpu["master params"] if split else 0)
    placement["CPU-updated chunks"] = HOST  # Plain host memory, not the pinned pool.
    note = f"the host's cores update {taken / total:.0%} of the host chunks' parameters"
    return dataclasses.replace(
        plan,
        state_bytes=state_bytes,
        placement=placement,
        on_cpu=frozenset(on_cpu),
        cpu_note=note,
    )


class CompiledTooLarge(ConfigError):
    """The compiled step does not fit beside the plan's device states; its temporaries took
    `beyond_estimate` bytes more than the planner's estimate of what they hold."""

    def __init__(self, message: str, beyond_estimate: int):
        super().__init__(message)
        self.beyond_estimate = beyond_estimate


def in_temporaries(plan: Plan) -> list[str]:
    """The plan's device states its compiled step holds as XLA temporaries: `IN_TEMPORARIES`,
    and without an offloaded optimizer the grads (the step is one program, which takes the
    params and optimizer state and gives them back, donated: its grads are neither)."""
    held = IN_TEMPORARIES + (() if plan.offloads_optimizer else ("grads",))
    return [s for s in held if plan.placement.get(s) == DEVICE]


def temporaries_estimate(plan: Plan) -> int:
    """The planner's estimate of the bytes its compiled step's temporaries take: the states
    `in_temporaries`, the grads beside the rest or, made after the step's activations
    (`Plan.grads_after_activations`), the larger of the two."""
    held = {s: plan.state_bytes[s] for s in in_temporaries(plan)}
    grads = held.pop("grads", 0)
    rest = sum(held.values())
    return max(rest, grads) if plan.grads_after_activations else rest + grads


def compiled_peak(plan: Plan, temp_bytes: int) -> int:
    """The plan's device peak with a compiled step's temporaries, `temp_bytes`, in place of
    the planner's estimate of the states they hold (`in_temporaries`)."""
    on_device = in_temporaries(plan)
    compiled = {**plan.state_bytes, **dict.fromkeys(on_device, 0), "activations": temp_bytes}
    return dataclasses.replace(plan, state_bytes=compiled).tier_bytes(DEVICE)


def more_devices() -> str:
    """The fix "more devices", but for emulated CPU devices, which share one host's memory
    (`tiers.measured_budget`): there fewer devices give each more."""
    if machine.backend() == "cpu" and jax.local_device_count() > 1:
        return (
            f"fewer emulated CPU devices (the {jax.local_device_count()} of "
            "--xla_force_host_platform_device_count share this host's memory)"
        )
    return "more devices"


def check_compiled(plan: Plan, memory) -> int:
    """Refuses, before the state is allocated, a plan whose compiled step would not fit the
    device: the plan's peak (`Plan.tier_bytes`) with what XLA allocates beyond the program's
    arguments and outputs (`memory`: a `Compiled.memory_analysis()`) in place of the
    planner's estimate of the states it holds (`in_temporaries`). Returns the temporaries'
    bytes beyond that estimate (`temporaries_estimate`; negative when below it; 0 without
    the analysis, where the estimate stands)."""
    if memory is None:
        return 0
    on_device = in_temporaries(plan)
    estimate = temporaries_estimate(plan)
    need = compiled_peak(plan, memory.temp_size_in_bytes)
    usable = USABLE * plan.budget[DEVICE]
    excess = memory.temp_size_in_bytes - estimate
    if need > usable:
        fixes = [*tiers.pool_fixes({DEVICE}), "config.offload.policy=auto or params"]
        if not plan.layer_inputs_on_host:
            fixes += ["config.offload.activations=host (with remat)"]
        if plan.remat != "full":
            fixes += ["more remat (config.model.remat=auto or full)"]
        fixes += ["a smaller batch or model", more_devices()]
        raise CompiledTooLarge(
            f"the compiled train step needs {need / 2**30:.1f} GiB per device "
            f"({memory.temp_size_in_bytes / 2**30:.1f} GiB of it XLA temporaries, against an "
            f"estimate of {estimate / 2**30:.1f} GiB for the {', '.join(on_device)}), more "
            f"than the {usable / 2**30:.1f} GiB usable: use {', '.join(fixes[:-1])} or "
            f"{fixes[-1]}",
            excess,
        )
    return excess
