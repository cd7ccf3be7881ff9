"""The update's chunks in a plan (a chunk: one weight, or a layer's slice of a stacked one,
with its master and optimizer state): their bytes per device, those kept on the device
(`with_resident`), the groups beside the step or between the next step's microbatches
(`with_step_chunks`), what they allocate in XLA's pinned-host pool (`pool_arrays`), and the
share the host's cores update (`hybrid_share`, `with_cpu_update`).
"""

import collections
import dataclasses

import jax
import numpy as np

from angel_jax import machine
from angel_jax.config import ConfigError
from angel_jax.planning import tiers
from angel_jax.planning.groups import (
    beside_step_groups,
    chunk_part,
    flight,
    group_chunks,
    in_flight_bytes,
    new_compute_bytes,
    slot_order,
    slot_size,
)
from angel_jax.planning.inputs import PlanInput
from angel_jax.planning.plan import STEP_ONLY, Plan, local_bytes
from angel_jax.planning.tiers import DEVICE, HOST, SSD, USABLE


def update_chunks(
    abstract_params, opt_abstract, stacked, state_bytes=local_bytes
) -> list[tuple[tuple[str, int | None], int, int]]:
    """((weight path, layer or None), master bytes, state bytes) of each update chunk; the
    state's bytes as `state_bytes` counts a parameter's state (`on_disk_bytes`: compressed)."""
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


def on_disk_bytes(state) -> int:
    """An optimizer state's bytes on disk with config.offload.ssd_compress: its float32
    leaves in bfloat16, the others as they are."""
    return sum(
        local_bytes(x) // (2 if x.dtype == np.float32 else 1) for x in jax.tree.leaves(state)
    )


def may_update_between_microbatches(inp: PlanInput, plan: Plan, pipelined: bool) -> bool:
    """Whether `plan`'s delayed update (config.offload.delayed_update) may run between the
    next step's microbatches, room allowing (`Plan.slot_bytes`): with microbatches, outside a
    pipeline (`pipelined`), layer streaming and the update inside the step."""
    o = inp.offload
    return bool(
        o.delayed_update
        and inp.train.microbatches > 1
        and not (pipelined or plan.streams_params or o.update_in_step)
    )


def with_resident(plan: Plan, resident: set, chunks) -> Plan:
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


def with_step_chunks(
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
        between = _between_microbatches(
            plan, updated, chunk_tiers, moved, placement, slots, weight_bytes
        )
        if between:
            return between
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


def _between_microbatches(
    plan: Plan, updated, chunk_tiers, moved, placement: dict, slots: int, weight_bytes
) -> Plan | None:
    """`plan` with its delayed update between the next step's `slots` + 1 microbatches
    (`with_step_chunks`, for the update's `updated` chunks (key, bytes) in its order, their
    tiers and the `moved` ones' bytes), or None where the slots would leave most of the moved
    bytes after the microbatches. Marks the new compute copy's tier in `placement`."""
    sizes = [size for _, size in updated]
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
        moved_bytes = lambda ks: sum(sizes[order[i]] for i in ks if chunk_tiers[order[i]] != DEVICE)
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
    return None


def pool_arrays(
    inp: PlanInput, plan: Plan, chunks, offloaded_masters, opt, stacked
) -> tiers.PoolArrays:
    """What `plan` allocates in XLA's pinned-host pool (`tiers.PoolArrays`): its host chunks'
    arrays in the state's initialisation's order, the streamed update's groups as
    `StreamedUpdate` makes them from `chunks` (`update_chunks`', in the plan's masters' bytes), and
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
    in_flight = 2 if plan.slot_bytes else inp.offload.chunks_in_flight
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
    beside = plan.copies_beside_step and not inp.offload.update_in_step
    chunk_states = ("master params", "optimizer state", "CPU-updated chunks")
    on_host = [
        s
        for s, t in plan.placement.items()
        if t == HOST and plan.state_bytes[s] and s not in chunk_states
    ]
    return tiers.PoolArrays(
        chunks=tuple(in_pool),
        groups=None if inp.offload.update_in_step else tuple(groups),
        in_flight=in_flight,
        ahead=ahead,
        left_home=(1 if plan.slot_bytes else leaving) if beside else 0,
        old_first=bool(plan.slot_bytes),
        lasting=tuple(plan.state_bytes[s] for s in on_host if s not in STEP_ONLY),
        per_step=tuple(plan.state_bytes[s] for s in on_host if s in STEP_ONLY),
        steps=inp.train.steps,
    )


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


def with_cpu_update(plan: Plan, share: float, host, split: bool = False) -> Plan:
    """`plan` with `share` of its host-memory chunks' (`host`) parameters updated by the host's
    cores, spread over the update's order, so that both the host and the device work from its
    start. `split`: `host` counts the masters' low halves (`Plan.split_masters`); the host's
    cores keep theirs whole, as they make the compute copy themselves."""
    if share > 0 and machine.process_count() > 1:
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
