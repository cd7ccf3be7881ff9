"""The memory tiers a ZeRO-Cache plan places states in, and what each may hold here: the
device's allocator limit, the pinned host pool's (XLA's pinned-host allocator, its cap and how
it grows), plain host memory and the SSD tier's disk.
"""

import math
import os
import pathlib
import shutil

import jax
import ml_collections

from angel_jax.config import ConfigError

DEVICE, HOST, SSD = "device", "pinned_host", "ssd"
CPU = "cpu"  # An update chunk's tier: plain host memory, updated by the host's cores.
# Fraction of a tier the plan may fill: XLA needs room for temporaries and fragmentation.
USABLE = 0.95


def measured_budget(config: ml_collections.ConfigDict, mesh) -> dict[str, int]:
    """Bytes per device for each tier: configured, else measured."""
    o = config.offload
    if o.device_gib > 0:
        device = int(o.device_gib * 2**30)
    else:
        first = jax.local_devices()[0]
        device = int((first.memory_stats() or {}).get("bytes_limit", 0))
        if not device and first.platform != "cpu":
            # An allocator that keeps no statistics (cuda_async may not): no device budget.
            raise ConfigError(
                f"the {first.platform} device allocator reports no memory limit: set "
                "config.offload.device_gib to the device memory the plan may use"
            )
        device = device or _host_available()  # CPU: host RAM.
    host = host_budget(int(o.host_gib * 2**30) if o.host_gib > 0 else _host_available())
    local_devices = max(1, mesh.size // jax.process_count())
    budget = {DEVICE: device, HOST: host // local_devices}
    if o.ssd_dir:
        if o.ssd_gib > 0:
            ssd = int(o.ssd_gib * 2**30)
        else:
            existing = pathlib.Path(o.ssd_dir).absolute()
            while not existing.exists():
                existing = existing.parent
            ssd = shutil.disk_usage(existing).free
        budget[SSD] = ssd // local_devices
    return budget


def host_budget(host: int, backend: str | None = None) -> int:
    """The pinned host tier's bytes out of `host`: on a GPU no more than XLA's pinned-host pool's
    cap, and, unless the pool is preallocated (already out of what the host has available),
    leaving the process its memory beside the pool."""
    if (backend or jax.default_backend()) != "gpu":
        return host
    cap = int(_pinned_pool_cap_gb() * 2**30)
    if _pool_preallocated():
        return max(0, min(host, cap))
    return max(0, min(host, cap, _host_available() - _BESIDE_POOL))


def _pinned_pool_cap_gb() -> float:
    return float(os.environ.get("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "64"))


def _pool_preallocated() -> bool:
    """XLA_PJRT_GPU_HOST_MEMORY_PREALLOCATE: the pinned-host pool is allocated whole, its cap,
    when the GPU client starts. It spares the run the pool's growth (on the H200 a 31 GiB region
    took 13.8 s to pin, inside a step) at the cost of pinning it all at start."""
    value = os.environ.get("XLA_PJRT_GPU_HOST_MEMORY_PREALLOCATE", "")
    return value.lower() in ("1", "true")


def pool_fixes(short: set[str], backend: str | None = None) -> list[str]:
    """On a GPU, the allocator settings that shrink the `short` tiers below what the machine
    has: the device pool (75% of the GPU unless told) and the pinned-host pool's cap (64 GB)."""
    if (backend or jax.default_backend()) != "gpu":
        return []
    fixes = []
    if DEVICE in short and "XLA_PYTHON_CLIENT_MEM_FRACTION" not in os.environ:
        fixes.append("a larger device pool (XLA_PYTHON_CLIENT_MEM_FRACTION=0.95; default 0.75)")
    cap = _pinned_pool_cap_gb()
    if HOST in short and cap * 2**30 < _host_available():
        fixes.append(
            f"a larger pinned-host pool (XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB, now {cap:g}; "
            f"the host has {_host_available() / 2**30:.0f} GiB available)"
        )
    return fixes


# XLA's pinned-host pool (a growing BFC allocator) adds regions of doubling size from 2 MiB up
# to its cap and keeps them, and pinned pages are resident: once more than 64 GiB live there, a
# 110 GiB cap is held whole (on the H200, 112 GiB of the process's pages were pinned after an
# AdamW 20B plan put 94.7 GiB there, and the kernel then killed it).
_POOL_FIRST_REGION = 2 * 2**20
# What the process holds beside the pool while it initialises and updates: there, with the pool
# capped at 100 GiB, 120.3 GiB were resident after the state's initialisation (8.5 GiB of it
# anonymous) and 122.7 GiB at the peak; the host budget leaves this much beside the pool.
_BESIDE_POOL = 24 * 2**30


def pinned_pool_hold(need: int, cap: int) -> int:
    """Bytes of pinned host memory the pool holds once `need` bytes live in it."""
    held, region = 0, _POOL_FIRST_REGION
    while held < need:
        held, region = held + region, 2 * region
    return min(held, cap)


def pool_overflow(plan, local_devices: int, backend: str | None = None) -> str:
    """On a GPU, why the pinned-host pool would hold more than this host can give beside the
    process and the host cores' chunks for `plan` (a `planner.Plan`): the kernel's OOM killer
    would end the run after the state's initialisation. Names the cap that fits; "" if it
    would not."""
    if (backend or jax.default_backend()) != "gpu":
        return ""
    # Chunks the host's cores update live in plain host memory, not the pool.
    plain = plan.state_bytes.get("CPU-updated chunks", 0) * local_devices
    need = plan.tier_bytes(HOST) * local_devices - plain
    cap = int(_pinned_pool_cap_gb() * 2**30)
    beside = f"{plain / 2**30:.1f} GiB of host-updated chunks and " if plain else ""
    available = _host_available()
    if _pool_preallocated():  # The pool is held already: `available` is what is left beside it.
        if plain + _BESIDE_POOL <= available:
            return ""
        return (
            f"XLA_PJRT_GPU_HOST_MEMORY_PREALLOCATE holds the pinned-host pool's whole cap "
            f"(XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB={_pinned_pool_cap_gb():g}) from the start, "
            f"leaving {available / 2**30:.1f} GiB, less than {beside}"
            f"{_BESIDE_POOL / 2**30:.0f} GiB for the process: lower the cap, or unset "
            f"XLA_PJRT_GPU_HOST_MEMORY_PREALLOCATE and let the pool grow"
        )
    held = pinned_pool_hold(need, cap)
    if held + plain + _BESIDE_POOL <= available:
        return ""
    fit = math.ceil(need / USABLE / 2**30)  # The smallest cap the plan's pool lives in.
    fixes = "a smaller config.offload.host_gib or config.offload.cpu_update"
    if fit * 2**30 + plain + _BESIDE_POOL <= available:
        fixes = f"set XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB={fit}, or {fixes}"
    else:  # No cap holds the plan's pool beside the process here.
        fixes = (
            f"no cap fits this host: use {fixes} (with config.offload.policy=auto and an SSD "
            f"tier, config.offload.ssd_dir, to take the rest), or a host with more memory"
        )
    return (
        f"XLA's pinned-host pool grows in doubling regions up to its cap and keeps them: for "
        f"this plan's {need / 2**30:.1f} GiB it would hold {held / 2**30:.1f} GiB "
        f"(XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB={_pinned_pool_cap_gb():g}), which with "
        f"{beside}{_BESIDE_POOL / 2**30:.0f} GiB for the process passes the "
        f"{available / 2**30:.1f} GiB this host has available: {fixes}"
    )


def _host_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
