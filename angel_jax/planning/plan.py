"""The ZeRO-Cache plan: which memory tier holds each model state, and its bytes per device
(`Plan`, made by `placement.make_plan`).

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
config.model.remat=auto: the fastest remat policy (activations.AUTO_REMATS, in their order) with
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
The tiers' budgets are measured in `tiers`, the update's chunks placed in `chunks`, its groups
made in `groups`.
"""

import dataclasses
import math

import jax
import numpy as np

from angel_jax.planning import tiers
from angel_jax.planning.tiers import CPU, DEVICE, HOST, SSD, USABLE

POLICIES = ("none", "optimizer", "params", "auto")
ACTIVATIONS = ("layer inputs", "activations", "offloaded activations")
# States alive only during the jitted forward/backward, and only during the streamed update
# that runs after it: a tier holds the larger of the two at a time, not both.
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
    # update takes them once all are freed (in moe_1b's step compiled for a GPU the
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
        """The plan as the log shows it: each state's tier and bytes, each tier's peak against
        its budget, and how the peaks count."""
        return _table(self)


def local_bytes(abstract_tree, dtype=None) -> int:
    total = 0
    for x in jax.tree.leaves(abstract_tree):
        shape = x.sharding.shard_shape(x.shape)
        total += math.prod(shape) * np.dtype(dtype or x.dtype).itemsize
    return total


def _table(plan: Plan) -> str:
    """`Plan.table`'s text, kept apart from the plan's accounting that it reports."""
    gib = lambda b: f"{b / 2**30:8.2f}"
    lines = [f"ZeRO-Cache plan (policy {plan.policy}, remat {plan.remat}), GiB per device:"]
    lines.append(f"  {'state':<22} {'tier':<12} {'GiB':>8}")
    for state, nbytes in plan.state_bytes.items():
        lines.append(f"  {state:<22} {plan.placement[state]:<12} {gib(nbytes)}")
    for tier in plan.budget:
        used, budget = plan.tier_bytes(tier), plan.budget[tier]
        lines.append(f"  {'peak ' + tier:<35} {gib(used)} of {gib(budget).strip()} budget")
    if "update chunks" in plan.state_bytes:
        lines.append(
            "  (a peak counts the step's activations and microbatch grads, with the "
            "update's groups beside them, or the update's chunks, the larger)"
        )
    if plan.offloads_optimizer and not plan.copies_beside_step:
        lines.append(
            "  no room beside the step for the update's groups: the update waits for its "
            "copies home, and fetches none before the step"
        )
    if plan.grads_after_activations:
        lines.append(
            "  (the unrolled layers' grads are made as their activations are freed: a "
            "peak counts the step's activations or the grads, the larger)"
        )
    lines.append(f"  model states: {plan.bytes_per_param():.1f} bytes per parameter")
    if plan.cpu_note:
        lines.append(f"  hybrid update: {plan.cpu_note}")
    if plan.pool_note:
        lines.append(f"  pinned-host pool: {plan.pool_note}")
    return "\n".join(lines)
