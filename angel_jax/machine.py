"""The machine the trainer plans for: this one, or one described to it. A GPU host can be
described on a machine without its GPU (compile-only devices from an XLA target description,
experiments/throughput.py's COMPILE_FOR_DEVICES): the trainer then picks kernels and budgets
host memory as it would there, and compiles for that GPU without running anything."""

import os
import re

# (backend, host bytes available, processes: 0 for jax's count, GPU compute capability).
_described: tuple[str, int, int, str] | None = None


def describe(
    backend: str | None, host_bytes: int = 0, processes: int = 0, capability: str = ""
) -> None:
    """Plan for a machine of `backend` ("gpu") with `host_bytes` of host memory available
    to each of `processes` processes (0: as many as jax has), from here on; None: for this
    machine again. A compile-only topology of many hosts has all its devices in this one
    process, where a run has one process a host. `capability`: the described GPU's compute
    capability ("9.0", `target_capability`), which picks the library kernels it runs (its
    compile-only devices have none)."""
    global _described
    _described = None if backend is None else (backend, host_bytes, processes, capability)


def target_capability(target_text: str) -> str:
    """The compute capability ("9.0") in an XLA GPU target description (text proto), or ""."""
    found = re.search(
        r"cuda_compute_capability\s*\{\s*major:\s*(\d+)\s*minor:\s*(\d+)", target_text
    )
    return f"{found.group(1)}.{found.group(2)}" if found else ""


def compute_capability() -> str:
    """The GPU's compute capability ("9.0"): the described one's, else jax's first device's
    ("?" where it has none: a CPU, a compile-only device)."""
    if _described and _described[3]:
        return _described[3]
    import jax

    return getattr(jax.devices()[0], "compute_capability", "?")


def process_count() -> int:
    """The processes the run's devices are spread over (each has its own host memory and
    pinned-host pool): the described machine's, else jax's."""
    if _described and _described[2]:
        return _described[2]
    import jax

    return jax.process_count()


def backend() -> str:
    """The backend the trainer plans and picks kernels for."""
    if _described:
        return _described[0]
    import jax

    return jax.default_backend()


def host_available() -> int:
    """Bytes of host memory available to the run: MemAvailable, or the described machine's."""
    if _described:
        return _described[1]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
