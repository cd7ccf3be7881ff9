"""The memory tiers a ZeRO-Cache plan places states in, and what each may hold here: the
device's allocator limit, the pinned host pool's (XLA's pinned-host allocator, its cap and how
it grows), plain host memory and the SSD tier's disk.
"""

import bisect
import collections
import dataclasses
import functools
import math
import os
import pathlib
import shutil

import jax
import ml_collections

from angel_jax import machine
from angel_jax.config import ConfigError

DEVICE, HOST, SSD = "device", "pinned_host", "ssd"
CPU = "cpu"  # An update chunk's tier: plain host memory, updated by the host's cores.
# Fraction of a tier the plan may fill: XLA needs room for temporaries and fragmentation.
USABLE = 0.95


def measured_budget(config: ml_collections.ConfigDict, devices: int) -> dict[str, int]:
    """Bytes per device for each tier, for a mesh of `devices`: configured, else measured.
    Emulated CPU devices (--xla_force_host_platform_device_count) share the one host's
    memory, so each gets its share of it."""
    o = config.offload
    local_devices = max(1, devices // machine.process_count())
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
        device = device or machine.host_available() // local_devices  # CPU: a share of RAM.
    host = host_budget(int(o.host_gib * 2**30) if o.host_gib > 0 else machine.host_available())
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
    if (backend or machine.backend()) != "gpu":
        return host
    cap = int(pinned_pool_cap_gb() * 2**30)
    if _pool_preallocated():
        return max(0, min(host, cap))
    return max(0, min(host, cap, machine.host_available() - BESIDE_POOL))


POOL_CAP = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"  # XLA's setting of the pool's cap, in GB.


def pinned_pool_cap_gb() -> float:
    """The cap XLA gives its pinned-host pool: the setting, else its default."""
    default = "16" if _pool_preallocated() else "64"  # XLA's defaults.
    return float(os.environ.get(POOL_CAP, default))


def _pool_preallocated() -> bool:
    """XLA_PJRT_GPU_HOST_MEMORY_PREALLOCATE: the pinned-host pool is allocated whole, its cap,
    when the GPU client starts. It spares the run the pool's growth (pinning a 31 GiB region took
    about 14 s, inside a step) at the cost of pinning it all at start."""
    value = os.environ.get("XLA_PJRT_GPU_HOST_MEMORY_PREALLOCATE", "")
    return value.lower() in ("1", "true")


def pool_fixes(
    short: set[str], backend: str | None = None, setting: str = "", available: int | None = None
) -> list[str]:
    """On a GPU, the allocator settings that shrink the `short` tiers below what the machine
    has (`available` bytes of host memory; measured if None): the device pool (75% of the GPU
    unless told) and the pinned-host pool's cap (64 GB; `setting`: the one that holds the
    plan, `pool_advice`'s)."""
    if (backend or machine.backend()) != "gpu":
        return []
    available = machine.host_available() if available is None else available
    fixes = []
    if DEVICE in short and "XLA_PYTHON_CLIENT_MEM_FRACTION" not in os.environ:
        fixes.append("a larger device pool (XLA_PYTHON_CLIENT_MEM_FRACTION=0.95; default 0.75)")
    cap = pinned_pool_cap_gb()
    if HOST in short and cap * 2**30 < available:
        named = f"{setting} for this plan" if setting else "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"
        fixes.append(
            f"a larger pinned-host pool ({named}, now {cap:g}; "
            f"the host has {available / 2**30:.0f} GiB available)"
        )
    return fixes


# XLA's pinned-host pool (`GetGpuHostAllocator`, xla/pjrt/gpu/gpu_helpers.cc): one BFC allocator
# (xla/tsl/framework/bfc_allocator.cc) per process over cudaHostAlloc'd regions, capped at
# XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB, growing unless XLA_PJRT_GPU_HOST_MEMORY_PREALLOCATE. Its
# regions never merge (the pinned sub-allocator does not coalesce them), are never given back
# (no garbage collection) and are pinned, so resident (an AdamW 20B plan that put 94.7 GiB
# there under a 110 GiB cap had 112 GiB of the process's pages pinned, and the kernel killed
# it). `PinnedPool` runs its rules; `replay_pool` feeds it a plan's arrays.
_POOL_FIRST_REGION = 2 * 2**20  # A growing pool's first region size.
_POOL_GRANULE = 256  # Allocations are rounded up to a multiple of this.
# A free chunk is split for an allocation if the rest is this large or the allocation's size;
# else the allocation takes it whole.
_POOL_SPLIT = 128 * 2**20
# The most steps replayed after the state's initialisation. The update's arrays drift in the
# pool (each group's new arrays take the best-fitting holes before its old ones go), so what a
# run needs grows with its steps: for the 8B 1M-token plan 81 GiB for 3 steps, 92 for 1000 and
# 93 for 10000 (the model's; 4 s for 1000 steps on one core).
_POOL_STEPS = 1000
# What the process holds beside the pool while it initialises and updates: with that 20B
# plan's pool capped at 100 GiB, 120.3 GiB were resident after the state's initialisation
# (8.5 GiB of it anonymous) and 122.7 GiB at the peak; the host budget leaves this much beside
# the pool. (The 8B 1M-token plan ran with a 110 GiB pool held whole on a host of about
# 120 GiB available, so it needs less beside; the 20B's figure stands, as the larger.)
BESIDE_POOL = 24 * 2**30


def _rounded(nbytes: int) -> int:
    return max(_POOL_GRANULE, -(-nbytes // _POOL_GRANULE) * _POOL_GRANULE)


class PinnedPool:
    """XLA's pinned-host pool as its BFC allocator runs it, allocation by allocation.

    An allocation takes the smallest free chunk that holds it (the lowest address among
    equals), split at its end when the rest is large (`_POOL_SPLIT`); a freed chunk merges
    with its region's free neighbours. When no chunk holds it, the pool adds a region
    (`BFCAllocator::Extend`): none if the allocation is larger than what the cap leaves (it
    fails at once); else of the current region size, doubled until it holds the allocation,
    or what the cap leaves if less; the size doubles for the next region unless it was raised
    for this one. A preallocated pool is one region, its cap. No allocation spans regions.
    (Addresses are the model's own: regions in the order they come, apart.)"""

    def __init__(self, cap: int, preallocated: bool = False):
        self.cap, self.held, self.in_use, self.most = cap, 0, 0, 0
        self._region = _rounded(cap if preallocated else min(cap, _POOL_FIRST_REGION))
        self._free = []  # (size, address) of the free chunks, sorted.
        self._chunks = {}  # Address -> [size, in use].
        self._ending = {}  # End address -> the chunk that ends there.
        self._end = 0  # Past the last region; the next starts a granule further.

    def alloc(self, nbytes: int) -> int | None:
        """The address `nbytes` get, or None if the pool has no room for them."""
        rounded = _rounded(nbytes)
        address = self._take(rounded)
        if address is None and self._extend(rounded):
            address = self._take(rounded)
        if address is not None:
            self.in_use += self._chunks[address][0]
            self.most = max(self.most, self.in_use)
        return address

    def free(self, address: int) -> None:
        size = self._chunks[address][0]
        self.in_use -= size
        self._drop(address)
        after = self._chunks.get(address + size)
        if after and not after[1]:
            self._drop(address + size)
            size += after[0]
        before = self._ending.get(address)
        if before is not None and not self._chunks[before][1]:
            size += self._chunks[before][0]
            self._drop(before)
            address = before
        self._put(address, size, False)

    def _take(self, rounded: int) -> int | None:
        k = bisect.bisect_left(self._free, (rounded, -1))
        if k == len(self._free):
            return None
        size, address = self._free[k]
        self._drop(address)
        if size >= 2 * rounded or size - rounded >= _POOL_SPLIT:
            self._put(address + rounded, size - rounded, False)
            size = rounded
        self._put(address, size, True)
        return address

    def _extend(self, rounded: int) -> bool:
        left = (self.cap - self.held) // _POOL_GRANULE * _POOL_GRANULE
        if rounded > left:
            return False
        raised = rounded > self._region
        while rounded > self._region:
            self._region *= 2
        size = min(self._region, left)
        if not raised:
            self._region *= 2
        address = self._end + _POOL_GRANULE
        self._end, self.held = address + size, self.held + size
        self._put(address, size, False)
        return True

    def _put(self, address: int, size: int, in_use: bool) -> None:
        self._chunks[address] = [size, in_use]
        self._ending[address + size] = address
        if not in_use:
            bisect.insort(self._free, (size, address))

    def _drop(self, address: int) -> None:
        size, in_use = self._chunks.pop(address)
        del self._ending[address + size]
        if not in_use:
            del self._free[bisect.bisect_left(self._free, (size, address))]


@dataclasses.dataclass(frozen=True)
class PoolArrays:
    """What a plan allocates in the pinned-host pool, per device, for `replay_pool`."""

    # Per update chunk in the pool, in the order the state's initialisation makes them (the
    # params' tree order), the bytes of its arrays there: its master (or low half), then its
    # optimizer state's (not its scalars, which stay on the device).
    chunks: tuple[tuple[int, ...], ...]
    # The streamed update's groups in its order, as indices into `chunks`: () for a group on
    # the SSD tier; left out, those that move nothing. None when the update runs inside the
    # step (its donated host buffers take its outputs).
    groups: tuple[tuple[int, ...], ...] = ()
    in_flight: int = 2  # `StreamedUpdate`'s groups on the device at once,
    ahead: int = 1  # fetched ahead,
    left_home: int = 0  # and left on their way home beside the next step.
    # A group's old arrays go before its new ones come (an update between microbatches).
    old_first: bool = False
    lasting: tuple[int, ...] = ()  # The plan's other states there, from the start.
    per_step: tuple[int, ...] = ()  # What the step holds there while it runs.
    steps: int = _POOL_STEPS  # The run's steps, for `replay_pool`.


@dataclasses.dataclass(frozen=True)
class PoolReplay:
    """What `replay_pool` found at `cap`: the bytes the pool held at the end (pinned, so
    resident), or when an allocation found no room; that allocation's bytes (0: none failed)
    and step (0: the state's initialisation); the most bytes in use at once (chunks as taken,
    whole)."""

    cap: int
    preallocated: bool
    held: int
    failed: int
    most: int
    step: int = 0

    @property
    def ok(self) -> bool:
        return not self.failed


class _NoRoom(Exception):
    pass


@functools.lru_cache(maxsize=256)
def replay_pool(
    arrays: PoolArrays, cap: int, preallocated: bool = False, devices: int = 1
) -> PoolReplay:
    """`arrays` allocated and freed in a `PinnedPool` of `cap` bytes in the run's order, each
    once per local device (`devices`, one pool): the state's initialisation, then the run's
    steps (`arrays.steps`, at most `_POOL_STEPS`), each holding its host arrays while it runs,
    then the streamed update. The update brings a group's new arrays home (its program's
    outputs, copied into new host buffers) before its old ones go: they go when the group is
    sent off (`GroupCopies.send_home`, and at the update's end but for the groups left on
    their way home), taken as no earlier (`Homebound.delete_ready` frees them only if their copies
    are done by then). Left out: the runtime's own small transfers through the pool (batches,
    metrics), and the hybrid update's and the SSD tier's copies."""
    pool = PinnedPool(cap, preallocated)

    def alloc(sizes) -> list[int]:
        out = []
        for nbytes in sizes:
            for _ in range(devices):
                address = pool.alloc(nbytes)
                if address is None:
                    raise _NoRoom(nbytes)
                out.append(address)
        return out

    def free(addresses) -> None:
        for address in addresses:
            pool.free(address)

    step = 0
    try:
        held = [alloc(sizes) for sizes in arrays.chunks]
        alloc(arrays.lasting)
        leaving = collections.deque()  # The old arrays of the groups on their way home.
        groups = arrays.groups or ()

        def make_room(fetched: set) -> None:
            while leaving and len(leaving) + len(fetched) >= arrays.in_flight:
                free(leaving.popleft())

        while step < min(arrays.steps, _POOL_STEPS):
            step += 1
            free(alloc(arrays.per_step))
            fetched = set(range(min(arrays.ahead, len(groups))))
            for g, ks in enumerate(groups):
                if g not in fetched:
                    make_room(fetched)
                fetched.discard(g)
                old = [a for k in ks for a in held[k]]
                if arrays.old_first:
                    free(old)
                    old = []
                for k in ks:
                    held[k] = alloc(arrays.chunks[k])
                leaving.append(old)
                if g + arrays.ahead < len(groups):
                    make_room(fetched)
                    fetched.add(g + arrays.ahead)
            while len(leaving) > arrays.left_home:
                free(leaving.popleft())
    except _NoRoom as no_room:
        return PoolReplay(cap, preallocated, pool.held, no_room.args[0], pool.most, step)
    return PoolReplay(cap, preallocated, pool.held, 0, pool.most)


def pool_setting(arrays: PoolArrays, devices: int, room: int, least: int = 0) -> PoolReplay | None:
    """The pinned-host pool's setting for `arrays` on `devices` local devices that holds no
    more than `room` bytes, as its replay: the smallest cap of a growing pool, else of a
    preallocated one, in whole GiB (as XLA reads it) and at least `least` bytes, at which
    every allocation finds room, and at the cap a GiB below too (a GiB of headroom for what
    the replay leaves out). None if neither holds no more than `room`."""
    total = devices * (sum(map(sum, arrays.chunks)) + sum(arrays.lasting))
    low = max(math.ceil(total / 2**30), math.ceil(least / 2**30), 1)
    for preallocated in (False, True):
        replay = lambda gib, p=preallocated: replay_pool(arrays, gib * 2**30, p, devices)
        below = replay(low - 1) if low > 1 else None
        for gib in range(low, 2 * low + 8):  # A growing pool's regions at most double it.
            at = replay(gib)
            if at.ok and below and below.ok:
                if at.held <= room:
                    return at
                break
            below = at
    return None


def pool_env(replay: PoolReplay) -> str:
    """The environment settings that make the pool of `replay`."""
    cap = f"XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB={replay.cap // 2**30}"
    if replay.preallocated:
        return f"XLA_PJRT_GPU_HOST_MEMORY_PREALLOCATE=true {cap}"
    return f"XLA_PJRT_GPU_HOST_MEMORY_PREALLOCATE=false {cap}" if _pool_preallocated() else cap


def _pool_check(plan, local_devices: int, available: int | None):
    """(the pool's replay at its settings here, whether it fits beside what else the host
    holds, the least setting that works and fits (`pool_setting`) or None, the host cores'
    chunks' bytes (plain memory), the bytes available) for `plan`."""
    # Chunks the host's cores update live in plain host memory, not the pool.
    plain = plan.state_bytes.get("CPU-updated chunks", 0) * local_devices
    available = machine.host_available() if available is None else available
    cap, preallocated = int(pinned_pool_cap_gb() * 2**30), _pool_preallocated()
    now = replay_pool(plan.pool, cap, preallocated, local_devices)
    # A preallocated pool is held already: `available` is what is left beside it.
    held = 0 if preallocated else now.held
    fits = now.ok and held + plain + BESIDE_POOL <= available
    # What the host can give the pool, a preallocated one's pages counted back in.
    room = available + (now.cap if preallocated else 0) - plain - BESIDE_POOL
    least = plan.tier_bytes(HOST) * local_devices / USABLE  # The plan's host budget's.
    return now, fits, pool_setting(plan.pool, local_devices, room, least), plain, available


def pool_overflow(
    plan, local_devices: int, backend: str | None = None, available: int | None = None
) -> str:
    """On a GPU, why XLA's pinned-host pool (as `replay_pool` models it) fails `plan` (a
    `plan.Plan`) here: an allocation finds no room in it (the run stops, RESOURCE_EXHAUSTED),
    or it holds more than this host (`available` bytes; measured if None) can give beside the
    host cores' chunks and the process (the kernel's OOM killer ends the run). Names the
    settings that work; "" if it would not fail."""
    if (backend or machine.backend()) != "gpu" or plan.pool is None:
        return ""
    now, fits, advice, plain, available = _pool_check(plan, local_devices, available)
    if fits:
        return ""
    setting = f"XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB={now.cap / 2**30:g}"
    if now.preallocated:
        setting = f"preallocated, {setting}"
    need = plan.tier_bytes(HOST) * local_devices - plain
    beside = f"{plain / 2**30:.1f} GiB of host-updated chunks and " if plain else ""
    fixes = "a smaller config.offload.host_gib or config.offload.cpu_update"
    if advice:
        fixes = f"set {pool_env(advice)} (it holds {advice.held / 2**30:.1f} GiB), or {fixes}"
    else:
        fixes = (
            f"no cap fits this host: use {fixes} (with config.offload.policy=auto and an SSD "
            f"tier, config.offload.ssd_dir, to take the rest), or a host with more memory"
        )
    if not now.ok:
        return (
            f"XLA's pinned-host pool ({setting}) runs out "
            f"{f'in step {now.step}' if now.step else 'in the state initialisation'}: a "
            f"{now.failed / 2**30:.2f} GiB allocation finds no room in its "
            f"{now.held / 2**30:.1f} GiB for the plan's {need / 2**30:.1f} GiB (no array spans "
            f"its regions, which double in size up to its cap, and the update brings a group's "
            f"new arrays home before its old ones go): {fixes}"
        )
    if now.preallocated:  # Held already: `available` is what it leaves.
        return (
            f"XLA's pinned-host pool ({setting}) holds its whole cap from the start, leaving "
            f"{available / 2**30:.1f} GiB, less than {beside}{BESIDE_POOL / 2**30:.0f} GiB "
            f"for the process: {fixes}"
        )
    return (
        f"XLA's pinned-host pool ({setting}) would hold {now.held / 2**30:.1f} GiB for this "
        f"plan's {need / 2**30:.1f} GiB (its regions, of doubling sizes up to its cap, are "
        f"pinned and kept), which with {beside}{BESIDE_POOL / 2**30:.0f} GiB for the process "
        f"passes the {available / 2**30:.1f} GiB this host has available: {fixes}"
    )


def pool_advice(
    plan, local_devices: int, backend: str | None = None, available: int | None = None
) -> str:
    """On a GPU, the pinned-host pool's settings that hold `plan` here (`pool_setting`), or
    "" if none does."""
    if (backend or machine.backend()) != "gpu" or plan.pool is None:
        return ""
    advice = _pool_check(plan, local_devices, available)[2]
    return pool_env(advice) if advice else ""


def pool_note(
    plan, local_devices: int, backend: str | None = None, available: int | None = None
) -> str:
    """On a GPU, the plan table's line on the pinned-host pool: what the setting in force
    holds for `plan` (`replay_pool`) and the least that works here (`pool_setting`)."""
    if (backend or machine.backend()) != "gpu" or plan.pool is None:
        return ""
    now, fits, advice, _, _ = _pool_check(plan, local_devices, available)
    least = f"{pool_env(advice)}, holding {advice.held / 2**30:.1f} GiB" if advice else "none"
    if not fits:
        return f"the setting in force fails this plan; the least that works here: {least}"
    note = f"{pool_env(now)} holds {now.held / 2**30:.1f} GiB, pinned"
    same = advice and (advice.cap, advice.preallocated) == (now.cap, now.preallocated)
    return note if same else f"{note}; the least that works here: {least}"


def more_devices() -> str:
    """The fix "more devices", but for emulated CPU devices, which share one host's memory
    (`measured_budget`): there fewer devices give each more."""
    if machine.backend() == "cpu" and jax.local_device_count() > 1:
        return (
            f"fewer emulated CPU devices (the {jax.local_device_count()} of "
            "--xla_force_host_platform_device_count share this host's memory)"
        )
    return "more devices"
