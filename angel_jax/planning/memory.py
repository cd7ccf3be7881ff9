"""The memory model both planners read: the pipeline's stage planner (planning/stage_plan.py)
and the ZeRO-Cache placement (planning/placement.py). What each ZeRO stage splits over `data`, the
bytes per parameter of the model states that follow, and what a layer keeps per token for its
backward pass under a remat policy (remat.REMATS), on one device of the mesh.
"""

import ml_dtypes
import numpy as np

from angel_jax.remat import OFFLOADABLE, REMATS

# The states ZeRO splits over `data`, each from the stage named (state_layout.py lays them out
# so; the ZeRO-Cache planner reads their bytes from those layouts).
ZERO_SPLITS = {"optimizer state": 1, "grads": 2, "params": 3}


def zero_splits(state: str, zero_stage: int) -> bool:
    """Whether ZeRO at `zero_stage` splits `state` (a key of ZERO_SPLITS) over `data`."""
    return zero_stage >= ZERO_SPLITS[state]


def splits_masters(compute_dtype) -> bool:
    """Whether a compute copy of `compute_dtype` is a float32 master's high half, so that the
    master's tier keeps only its low half (config.offload.split_masters, offload/masters.py)."""
    return np.dtype(compute_dtype) == np.dtype(ml_dtypes.bfloat16)


def state_bytes_per_param(zero_stage: int, ranks: int) -> float:
    """Bytes per device of one parameter's float32 states, split over ZeRO's `ranks` devices
    as `zero_stage` says: the param, its grad (a pipeline's grad accumulator) and AdamW's two
    moments."""
    share = {s: 1 / ranks if zero_splits(s, zero_stage) else 1 for s in ZERO_SPLITS}
    return 4 * share["params"] + 4 * share["grads"] + 8 * share["optimizer state"]


def per_device_widths(
    d_model: int, heads: int, kv_heads: int, head_dim: int, ffn_dim: int, tensor: int, sp: bool
) -> tuple[float, float, float, float]:
    """The units of remat's widths on one device: (model dim, attention width, KV width, FFN
    width), heads and FFN split over `tensor` (KV heads unless fewer than its ranks), the model
    dim only in norm regions under sequence parallel (`sp`)."""
    d = d_model / (tensor if sp else 1)
    kv = kv_heads * head_dim / (tensor if kv_heads % tensor == 0 else 1)
    return d, heads * head_dim / tensor, kv, ffn_dim / tensor


def saved_values(
    remat: str,
    widths: tuple[float, float, float, float],
    xla_keys: float = 0,
    itemsize: int = 2,
) -> tuple[float, float]:
    """(values of `itemsize` bytes a layer keeps on the device per token for its backward
    pass, its input included; values it keeps in pinned host memory) under REMATS[remat], for
    `widths` from `per_device_widths`; `xla_keys`: on XLA's attention, the heads on a device
    times the key positions a query attends to (0 on cuDNN's)."""
    policy = REMATS[remat]
    dot = lambda units: sum(u * w for u, w in zip(units, widths, strict=True))
    device = dot(policy.widths)
    if xla_keys:
        device += dot(policy.xla_widths) + policy.xla_scores * xla_keys / itemsize
    return device, sum(dot(OFFLOADABLE[name]) for name in policy.offloaded)
