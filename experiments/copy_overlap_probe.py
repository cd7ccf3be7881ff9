"""Probe for the ZeRO-Cache update's copies beside compute (the ZeRO-Cache issue's item 1): do
runtime copies between pinned host memory and the device (`jax.device_put`, as the streamed
update issues them) run beside a compute program, and does it matter in which order they are
queued?

    python experiments/copy_overlap_probe.py [--gib 8 --chunks 32 --matmuls 120] [--out FILE]
        [--only "in program;both"] [--copies-open 8] [--xla NAME=VALUE,...]... [--timeline FILE]

Each case is timed as a whole (dispatch to last result ready), 5 times after a warm-up; a
case overlaps if it takes about max(compute, copies) rather than their sum:
  compute                 a chain of bf16 matmuls (~0.15 s)
  h2d / d2h / both        the copies alone (`--gib` each way, in `--chunks` arrays)
  h2d then compute        copies queued before the program
  compute then h2d        copies queued after it (the runtime may order them behind it)
  d2h then compute, compute then d2h, both then compute
  update schedule         the streamed update's steady state: last step's results sent home
                          (and deleted), the next step's state fetched, then the program,
                          then one small kernel a chunk on the fetched state
  chained                 a kernel's results sent home and fetched back at once, then the
                          program: the time the caller spends queueing the fetch is printed
  512 h2d ...             the same bytes down in 512 copies, then the program, with and
                          without a tiny program launched between (H200: no
                          difference, 224.5 and 228.0 ms)
  in program h2d / d2h / both
                          the copies inside one jitted program (`jax.device_put` to a
                          memory space, as the update in the step issues them): does one
                          program move both directions at once? (H200, jax 0.11.2: no.
                          Each alone 156 ms, both 295-308 ms (276 with 32 copies open), the
                          copies one at a time over 4 streams, whatever `--xla` options.)
  in program both, barrier
                          the same with every source made ready at one point (an
                          optimization barrier), so that no copy's start follows another's end
                          (in-program cases compiled with `--copies-open` copies open at most,
                          8 as the update in the step is, and any `--xla` options)
and the host's memory bandwidth (numpy copies on 1-16 threads), which the copies share.
A probe for the design, not a trainer feature.
"""

import argparse
import concurrent.futures as futures
import gzip
import json
import pathlib
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding
from profile_step import timeline
from throughput import most_copies_open, write_results


def host_memory_rate(threads: int, gib: float = 4.0, reps: int = 3) -> float:
    """The host's memory bandwidth as `threads` numpy copies of `gib` in all see it: bytes read
    plus bytes written per second (the copies to and from the device and the host's update
    share it)."""
    n = int(gib * 2**30 / 4 / threads)
    pairs = [(np.ones(n, np.float32), np.zeros(n, np.float32)) for _ in range(threads)]
    with futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda p: np.copyto(p[1], p[0]), pairs))  # Pages touched.
        start = time.perf_counter()
        for _ in range(reps):
            list(pool.map(lambda p: np.copyto(p[1], p[0]), pairs))
        seconds = time.perf_counter() - start
    rate = 2 * n * 4 * threads * reps / seconds / 1e9
    print(f"host memory, {threads:2d} threads copying: {rate:6.1f} GB/s (read + written)")
    return rate


def option(name_value: list[str]) -> tuple[str, bool | int | str]:
    """A compiler option from the command line, typed as XLA wants it."""
    if len(name_value) != 2:
        raise SystemExit(f"--xla {name_value[0]}: give NAME=VALUE")
    name, value = name_value
    typed = {"true": True, "false": False}.get(value.lower(), value)
    return name, int(value) if value.lstrip("-").isdigit() else typed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=8.0, help="bytes copied each way")
    parser.add_argument("--chunks", type=int, default=32)
    parser.add_argument("--matmuls", type=int, default=120, help="8192^3 bf16 matmuls")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", default="")
    parser.add_argument("--only", default="", help="';'-separated: the cases whose name has one")
    parser.add_argument("--copies-open", type=int, default=8, help="in-program copies open")
    parser.add_argument(
        "--xla",
        action="append",
        default=[],
        help="compiler options (name=value,...) to try on the in-program both-ways copies: "
        "each --xla is one more case",
    )
    parser.add_argument(
        "--timeline",
        default="",
        help="write each in-program case's traced time line (which stream each copy ran on, "
        "and when) to this file",
    )
    args = parser.parse_args()

    device = jax.devices()[0]
    on_device = SingleDeviceSharding(device)
    pinned = SingleDeviceSharding(device, memory_kind="pinned_host")
    n = int(args.gib * 2**30 / 4 / args.chunks)

    @jax.jit
    def compute(x):
        return jax.lax.fori_loop(0, args.matmuls, lambda _, y: (y @ x) * 1e-3, x)

    plus_one = jax.jit(lambda y: y + 1)
    bump = jax.jit(lambda y: y + 1, donate_argnums=0)  # The update's kernel on a fetched chunk.
    x = jax.device_put(jnp.ones((8192, 8192), jnp.bfloat16), on_device)
    zeros = np.zeros(n, np.float32)
    host = [jax.device_put(zeros, pinned) for _ in range(args.chunks)]
    ready = [jax.device_put(zeros, on_device) for _ in range(args.chunks)]
    jax.block_until_ready((host, ready, compute(x)))

    def h2d():
        return jax.device_put(host, [on_device] * len(host))

    def d2h():
        return jax.device_put(ready, [pinned] * len(ready))

    def schedule():
        """Home the last results, fetch the next state, run the step, then the update."""
        nonlocal ready
        gone = jax.device_put(ready, [pinned] * len(ready))
        for r in ready:
            r.delete()
        fetched = h2d()
        y = compute(x)
        ready = [bump(f) for f in fetched]
        return gone, y, ready

    def chained():
        """Results made by a kernel, sent home, and fetched again before the program: does
        queueing the fetch (whose source is not there yet) hold up the caller?"""
        made = [plus_one(r) for r in ready]
        gone = jax.device_put(made, [pinned] * len(made))
        start = time.perf_counter()
        back = jax.device_put(gone, [on_device] * len(gone))
        chained_call_s.append(time.perf_counter() - start)
        return back, compute(x)

    # The streamed update queues hundreds of small copies. Does PJRT's worker thread then
    # enqueue them after the next program launched (they would wait for all of it), and does
    # a tiny program launched first stop that? On the H200, neither: the pair takes the same.
    many = [
        jax.device_put(np.zeros(n * args.chunks // 512, np.float32), pinned) for _ in range(512)
    ]
    tiny = jax.jit(lambda: jnp.zeros((), jnp.int8), out_shardings=on_device)

    def many_h2d(tick: bool):
        copies = [jax.device_put(h, on_device) for h in many]
        return copies, tiny() if tick else None, compute(x)

    space = jax.memory.Space

    def moved(arrays, to):
        return [jax.device_put(a, to) for a in arrays]

    programs = {
        "in program h2d": jax.jit(lambda hs: moved(hs, space.Device)),
        "in program d2h": jax.jit(lambda rs: moved(rs, space.Host)),
        "in program both": jax.jit(lambda hs, rs: (moved(hs, space.Device), moved(rs, space.Host))),
        "in program both, barrier": jax.jit(
            lambda hs, rs: (
                lambda both: (moved(both[0], space.Device), moved(both[1], space.Host))
            )(jax.lax.optimization_barrier((hs, rs)))
        ),
    }
    # Read when called: "update schedule" replaces `ready` with the arrays it makes.
    program_args = {
        "in program h2d": lambda: (host,),
        "in program d2h": lambda: (ready,),
        "in program both": lambda: (host, ready),
        "in program both, barrier": lambda: (host, ready),
    }
    # XLA:GPU keeps at most this many of a program's asynchronous copies open (its default: 2).
    options = {"xla_gpu_experimental_parallel_async_compute_limit": args.copies_open}
    compiled = {
        name: fn.lower(*program_args[name]()).compile(compiler_options=options)
        for name, fn in programs.items()
    }
    both = programs["in program both"].lower(*program_args["in program both"]())
    for tried in args.xla:  # The both-ways program under other options, e.g. stream settings.
        more = dict(map(option, (kv.split("=", 1) for kv in tried.split(",") if kv)))
        try:
            compiled[f"in program both [{tried}]"] = both.compile({**options, **more})
        except jax.errors.JaxRuntimeError as e:  # An option this XLA does not know.
            print(f"--xla {tried}: {e}", flush=True)
            continue
        program_args[f"in program both [{tried}]"] = program_args["in program both"]
    # Asynchronous copies in each compiled program (copy-start/copy-done pairs), and the most
    # its schedule keeps open at once.
    copy_starts = {name: c.as_text().count(" copy-start(") for name, c in compiled.items()}
    copies_open = {name: most_copies_open(c.as_text()) for name, c in compiled.items()}
    print(f"most copies open: {copies_open}", flush=True)
    print(f"copy-starts: {copy_starts}", flush=True)

    chained_call_s = []
    cases = {
        "compute": lambda: compute(x),
        "h2d": h2d,
        "d2h": d2h,
        "both": lambda: (h2d(), d2h()),
        "h2d then compute": lambda: (h2d(), compute(x)),
        "compute then h2d": lambda: (compute(x), h2d()),
        "d2h then compute": lambda: (d2h(), compute(x)),
        "compute then d2h": lambda: (compute(x), d2h()),
        "both then compute": lambda: (h2d(), d2h(), compute(x)),
        "compute then both": lambda: (compute(x), h2d(), d2h()),
        "update schedule": schedule,
        "chained": chained,
        "512 h2d then compute": lambda: many_h2d(False),
        "512 h2d, tiny program, compute": lambda: many_h2d(True),
        **{name: lambda c=c, name=name: c(*program_args[name]()) for name, c in compiled.items()},
    }
    if args.only:
        cases = {k: v for k, v in cases.items() if any(p in k for p in args.only.split(";"))}
    for _ in range(3):  # The pinned pool's first copies crawl: warmed first.
        jax.block_until_ready((h2d(), d2h()))
    seconds = {}
    for name, fn in cases.items():
        jax.block_until_ready(fn())
        times = []
        for _ in range(args.reps):
            start = time.perf_counter()
            jax.block_until_ready(fn())
            times.append(time.perf_counter() - start)
        seconds[name] = float(np.median(times))
        print(f"{name:22s} {seconds[name] * 1e3:8.1f} ms", flush=True)
    if args.timeline:
        lines = []
        for name in (k for k in cases if k.startswith("in program")):
            with tempfile.TemporaryDirectory() as trace_dir:
                with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
                    jax.block_until_ready(cases[name]())
                trace_file = next(pathlib.Path(trace_dir).rglob("perfetto_trace.json.gz"))
                trace = json.loads(gzip.decompress(trace_file.read_bytes()))
            lines += [f"== {name}", *timeline(trace, min_host_ms=1.0)]
        pathlib.Path(args.timeline).write_text("\n".join(lines) + "\n")
    nbytes = args.chunks * n * 4
    summary = dict(
        host_memory_gb_per_s={t: host_memory_rate(t) for t in (1, 4, 8, 16)}
        if not args.only or "host memory" in args.only
        else None,
        gib_each_way=nbytes / 2**30,
        chunks=args.chunks,
        # The bytes each copy case moves (both directions' for "both") over its time.
        gb_per_s={
            k: (2 if "both" in k else 1) * nbytes / t / 1e9
            for k, t in seconds.items()
            if k in ("h2d", "d2h", "both") or k.startswith("in program")
        },
        seconds=seconds,
        in_program_copy_starts=copy_starts,
        in_program_most_copies_open=copies_open,
        in_program_compiler_options=options,
        # How long queueing the chained fetch took the caller (median).
        chained_fetch_call_s=float(np.median(chained_call_s)) if chained_call_s else None,
    )
    print(summary)
    if args.out:
        write_results(args.out, [summary])
    return 0


if __name__ == "__main__":
    sys.exit(main())
