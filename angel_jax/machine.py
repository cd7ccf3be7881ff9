"""The machine the trainer plans for: this one, or one described to it. A GPU host can be
described on a machine without its GPU (compile-only devices from an XLA target description,
experiments/throughput.py's COMPILE_FOR_DEVICES): the trainer then picks kernels and budgets
host memory as it would there, and compiles for that GPU without running anything."""

import os

_described: tuple[str, int] | None = None  # (backend, host bytes available).


def describe(backend: str | None, host_bytes: int = 0) -> None:
    """Plan for a machine of `backend` ("gpu") with `host_bytes` of host memory available,
    from here on; None: for this machine again."""
    global _described
    _described = None if backend is None else (backend, host_bytes)


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
