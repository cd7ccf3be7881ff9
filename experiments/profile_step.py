"""Where one train step's GPU time goes: a profiler trace of a few steps, summed per kind of
kernel, with the top HLO ops and the JAX code each comes from.

    python experiments/profile_step.py [--config configs/llama_1b.py] [--steps 3] [--warmup 3] \
        [--out runs/experiments/profile_llama_1b.json] [-- --config.train.batch_size=16 ...]

Writes the table, a JSON summary (`--out`), and beside it the optimized HLO (`.hlo.txt.gz`), the
Perfetto trace (`.trace.json.gz`, open it in ui.perfetto.dev) and a condensed time line of it
(`.timeline.txt`: each stream's runs of work and the host's blocking calls, in order).
"""

import argparse
import collections
import gzip
import json
import pathlib
import re
import shutil
import sys
import tempfile
import time

import numpy as np
from throughput import ROOT, write_results

# Kernel kinds, by the first pattern a kernel's name matches (lower-cased).
KINDS = [
    ("attention (cuDNN)", ("cudnn", "fmha", "flash", "sdpa")),
    ("matmul", ("gemm", "cublas", "xmma", "nvjet", "cutlass", "matmul", "dot")),
    ("collective", ("nccl", "all-reduce", "all-gather", "reduce-scatter", "all-to-all")),
    ("copy", ("memcpy", "memset", "copy")),
    ("triton fusion", ("triton",)),
    ("reduction", ("reduce", "scatter")),
    ("elementwise fusion", ("fusion", "loop", "input")),
]


# A step's backward pass has no gap this long (µs) between kernels that name their HLO op;
# steps are further apart (their forward passes).
BACKWARD_GAP_US = 50e3


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, patterns in KINDS:
        if any(p in low for p in patterns):
            return kind
    return "other"


def event_op(e: dict) -> str:
    """A kernel event's HLO op (its name where the trace gives none)."""
    args = e.get("args", {})
    return args.get("hlo_op") or args.get("name") or e["name"]


def event_kind(e: dict) -> str:
    return kind_of(e["name"] + " " + event_op(e))


def device_events(trace: dict) -> dict[str, list[dict]]:
    """Complete events of each GPU stream, keyed by "process/thread" name."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    procs = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    threads = {
        (e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("name") == "thread_name"
    }
    streams = collections.defaultdict(list)
    for e in events:
        if e.get("ph") != "X" or "GPU" not in procs.get(e["pid"], ""):
            continue
        thread = threads.get((e["pid"], e.get("tid")), "")
        streams[f"{procs[e['pid']]}/{thread}"].append(e)
    return streams


def merged(events: list[dict]) -> list[tuple[float, float]]:
    """The union of the events' intervals, as sorted disjoint (start, stop) pairs."""
    return spans(sorted((e["ts"], e["ts"] + e["dur"]) for e in events), 0.0)


def spans(intervals: list[tuple[float, float]], gap_us: float) -> list[tuple[float, float]]:
    """Sorted intervals joined where at most `gap_us` apart: the stretches of time a kind of
    work runs in, waits inside it included."""
    out: list[tuple[float, float]] = []
    for start, stop in intervals:
        if out and start - out[-1][1] <= gap_us:
            out[-1] = (out[-1][0], max(out[-1][1], stop))
        else:
            out.append((start, stop))
    return out


def length(intervals: list[tuple[float, float]]) -> float:
    return sum(stop - start for start, stop in intervals)


def overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of the intersection of two merged interval lists."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def busy_us(events: list[dict]) -> float:
    """Length of the union of the events' intervals (overlapping kernels count once)."""
    return length(merged(events))


def hlo_sources(hlo_text: str) -> dict[str, str]:
    """HLO instruction name -> the JAX op path in its metadata (where the op came from)."""
    sources = {}
    for m in re.finditer(r"^\s*(?:ROOT )?%?([\w.\-]+) = .*?op_name=\"([^\"]+)\"", hlo_text, re.M):
        sources.setdefault(m.group(1), m.group(2))
    return sources


def is_dma(e: dict) -> bool:
    """A copy engine's transfer (host<->device), not an XLA copy kernel."""
    return e["name"].lower().startswith("memcpy")


def source_of(op: str, kernel: str, sources: dict[str, str]) -> str:
    """The JAX op path a kernel comes from. Kernels inside command buffers name their fusion:
    "fusion_12" is "fusion.12"."""
    return sources.get(op) or sources.get(re.sub(r"_(\d+)$", r".\1", kernel), "")


def is_backward(e: dict, sources: dict[str, str]) -> bool:
    """A kernel of the backward pass: it comes from a transposed (vjp) JAX op."""
    return "transpose(" in source_of(event_op(e), e["name"], sources)


def communication(events: list[dict], dma: bool = False) -> dict:
    """One GPU's time in collectives (dma: in host<->device transfers) and how much of it ran
    while compute kernels ran too."""
    comm, compute = [], []
    for e in events:
        k = event_kind(e)
        wanted = is_dma(e) if dma else k == "collective"
        if wanted:
            comm.append(e)
        elif k not in ("collective", "copy"):
            compute.append(e)
    comm_us = length(merged(comm))
    hidden_us = overlap(merged(comm), merged(compute))
    return dict(
        collective_us=comm_us,
        exposed_collective_us=comm_us - hidden_us,
        overlapped_fraction=hidden_us / comm_us if comm_us else None,
    )


# Host events worth a line of the timeline: the runtime's blocking points, program launches,
# copies' dispatch and pinned-memory allocations (a growing pinned pool stalls the caller).
_HOST_MARKS = ("Wait", "Execute (", "CopyToMemorySpace", "cuMemHostAlloc", "block_until_ready")


def timeline(trace: dict, min_host_ms: float = 1.0, every_host_event: bool = False) -> list[str]:
    """The trace as a condensed time line, one line per run of work: each GPU stream's
    consecutive kernels of one program (compute stream) or copies of one direction (copy
    streams) merged, and the host's blocking events (or with `every_host_event` all its events:
    Python calls too, when traced) longer than `min_host_ms`. Shows what
    waits for what: a program that starts only when a host call returns, copies queued
    behind a program, the host thread stuck in an allocation."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    procs = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    threads = {
        (e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("name") == "thread_name"
    }
    rows = []
    for stream, es in device_events(trace).items():
        compute = "Compute" in stream
        run = None
        for e in sorted(es, key=lambda e: e["ts"]):
            label = (
                e.get("args", {}).get("hlo_module", e["name"])
                if compute
                else (
                    "host->device"
                    if "H2D" in e["name"]
                    else "device->host"
                    if "D2H" in e["name"]
                    else e["name"]
                )
            )
            if run and run[2] == label and e["ts"] - run[1] < 30:  # µs: the same run of work.
                run[1], run[3] = max(run[1], e["ts"] + e["dur"]), run[3] + 1
            else:
                if run:
                    rows.append((run[0], run[1], stream.split("/")[-1], f"{run[2]} x{run[3]}"))
                run = [e["ts"], e["ts"] + e["dur"], label, 1]
        if run:
            rows.append((run[0], run[1], stream.split("/")[-1], f"{run[2]} x{run[3]}"))
    start = min((r[0] for r in rows), default=0.0)
    for e in events:
        if e.get("ph") != "X" or "GPU" in procs.get(e["pid"], ""):
            continue
        marked = every_host_event or any(m in e["name"] for m in _HOST_MARKS)
        if e["dur"] >= min_host_ms * 1e3 and marked:
            thread = threads.get((e["pid"], e.get("tid")), "")
            detail = e.get("args", {}).get("memalloc_details", "")
            rows.append((e["ts"], e["ts"] + e["dur"], f"host {thread}", f"{e['name']} {detail}"))
    return [
        f"{(t0 - start) / 1e3:10.2f} ms {(t1 - t0) / 1e3:9.2f} ms  {where[:28]:28s} {what[:100]}"
        for t0, t1, where, what in sorted(rows)
    ]


def summarize(trace: dict, steps: int, hlo_text: str, top: int) -> dict:
    """Per-step milliseconds per kernel kind, busy time and the collectives' overlap with compute
    on each GPU (averaged over GPUs where there are several), and the top kernels."""
    streams = device_events(trace)
    if not streams:
        raise SystemExit("the trace has no GPU events: is this a GPU run?")
    # Kernel streams: not the XLA op/module marker lines.
    per_gpu = collections.defaultdict(list)
    for name, stream in streams.items():
        gpu, thread = name.rsplit("/", 1)
        if "XLA" not in thread:
            per_gpu[gpu].extend(stream)
    n = len(per_gpu)
    sources = hlo_sources(hlo_text)
    by_kind, by_name = collections.Counter(), collections.Counter()
    gpus = {}
    for gpu, events in sorted(per_gpu.items()):
        span_us = max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)
        busy = busy_us(events)
        comm, copies = communication(events), communication(events, dma=True)
        backward = [e for e in events if event_kind(e) != "copy" and is_backward(e, sources)]
        dma = merged([e for e in events if is_dma(e)])
        backward_spans = spans(merged(backward), BACKWARD_GAP_US)
        gpus[gpu] = dict(
            span_ms_per_step=span_us / 1e3 / steps,
            busy_ms_per_step=busy / 1e3 / steps,
            idle_fraction=1 - busy / span_us,
            collective_ms_per_step=comm["collective_us"] / 1e3 / steps,
            exposed_collective_ms_per_step=comm["exposed_collective_us"] / 1e3 / steps,
            collective_overlapped_fraction=comm["overlapped_fraction"],
            # Host<->device copies (the offloaded update's): their time beside compute kernels.
            copy_ms_per_step=copies["collective_us"] / 1e3 / steps,
            exposed_copy_ms_per_step=copies["exposed_collective_us"] / 1e3 / steps,
            copy_overlapped_fraction=copies["overlapped_fraction"],
            # Of those, the time during the backward pass (config.offload.update_in_step: the
            # update's copies while the backward runs): from its first kernel to its last in
            # each step. Kernels inside command buffers name no HLO op, so a step's backward
            # is the stretch of its known kernels at most BACKWARD_GAP_US apart.
            backward_ms_per_step=length(backward_spans) / 1e3 / steps,
            copy_during_backward_ms_per_step=overlap(dma, backward_spans) / 1e3 / steps,
        )
        for e in events:
            kind = event_kind(e)
            by_kind[kind] += e["dur"] / n
            by_name[(kind, event_op(e), e["name"][:80])] += e["dur"] / n
    mean = {}
    for key in next(iter(gpus.values())):  # Over the GPUs that have a value.
        values = [g[key] for g in gpus.values() if g[key] is not None]
        mean[key] = sum(values) / len(values) if values else None
    return dict(
        steps=steps,
        **mean,
        gpus=gpus,
        streams={k: len(v) for k, v in streams.items()},
        ms_per_step_by_kind={k: v / 1e3 / steps for k, v in by_kind.most_common()},
        top=[
            dict(
                kind=kind,
                hlo_op=op,
                kernel=label,
                ms_per_step=us / 1e3 / steps,
                source=source_of(op, label, sources),
            )
            for (kind, op, label), us in by_name.most_common(top)
        ],
    )


def print_summary(s: dict) -> None:
    for gpu, g in s["gpus"].items():
        print(
            f"\n{gpu} per step: span {g['span_ms_per_step']:.1f} ms, busy"
            f" {g['busy_ms_per_step']:.1f} ms (idle {g['idle_fraction']:.1%})"
        )
        if g["collective_overlapped_fraction"] is not None:
            print(
                f"  collectives {g['collective_ms_per_step']:.1f} ms, of which"
                f" {g['collective_overlapped_fraction']:.1%} overlap compute kernels; exposed"
                f" {g['exposed_collective_ms_per_step']:.1f} ms"
            )
        if g["copy_overlapped_fraction"] is not None:
            print(
                f"  copies {g['copy_ms_per_step']:.1f} ms, of which"
                f" {g['copy_overlapped_fraction']:.1%} overlap compute kernels; exposed"
                f" {g['exposed_copy_ms_per_step']:.1f} ms; during the backward pass"
                f" ({g['backward_ms_per_step']:.1f} ms) {g['copy_during_backward_ms_per_step']:.1f}"
                " ms"
            )
    print("\nmean over GPUs:")
    total = sum(s["ms_per_step_by_kind"].values())
    print(f"{'kind':<22} {'ms/step':>8} {'share':>6}")
    for kind, ms in s["ms_per_step_by_kind"].items():
        print(f"{kind:<22} {ms:>8.2f} {ms / total:>6.1%}")
    print(f"\n{'kind':<20} {'ms/step':>8}  hlo op / kernel / source")
    for t in s["top"]:
        print(f"{t['kind']:<20} {t['ms_per_step']:>8.3f}  {t['hlo_op']}  {t['kernel'][:50]}")
        if t["source"]:
            print(f"{'':<30}{t['source'][-110:]}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", default=str(ROOT / "configs/llama_1b.py"))
    p.add_argument("--steps", type=int, default=3, help="traced steps")
    p.add_argument("--warmup", type=int, default=3, help="untraced steps before them")
    p.add_argument("--top", type=int, default=30)
    p.add_argument(
        "--host-trace",
        action="store_true",
        help="trace Python calls too; the timeline lists every host event of 0.5 ms or more",
    )
    p.add_argument(
        "--guarded",
        action="store_true",
        help="trace the step the loop runs by default, which skips anomalous steps "
        "(config.monitor.on_anomaly=skip; no loss ceiling), not the unguarded one",
    )
    p.add_argument("--out", default=str(ROOT / "runs/experiments/profile_llama_1b.json"))
    p.add_argument("overrides", nargs="*", help="config overrides, after --")
    a = p.parse_args()
    sys.path.insert(0, str(ROOT))
    import jax

    from angel_jax.config import load_config
    from angel_jax.data import make_batches
    from angel_jax.mesh import make_mesh
    from angel_jax.train import build

    # `build` checks the step the loop runs, here the one traced: the guarded one or not.
    guard = "skip" if a.guarded else "log"
    base = ["--config.data.synthetic=true", f"--config.monitor.on_anomaly={guard}"]
    config = load_config(a.config, [*base, *a.overrides])
    exp = build(config, make_mesh(config.mesh))
    if a.guarded:
        train_step = lambda state, batch: exp.guarded_train_step(state, batch, float("inf"))
    else:
        train_step = exp.train_step
    # An offloaded step is a forward/backward program, then the streamed update's programs
    # (or one program, config.offload.update_in_step).
    if exp.plan.offloads_optimizer:
        program = exp.steps.program
    else:
        program = exp.steps.guarded_program if a.guarded else exp.train_step
    state = exp.init_state()
    batches = make_batches(config).iterate(0)
    for _ in range(a.warmup):
        state, metrics = train_step(state, exp.global_batch(next(batches)))
    jax.block_until_ready(state)
    trace_dir = pathlib.Path(tempfile.mkdtemp(prefix="angel_profile_"))
    options = jax.profiler.ProfileOptions()
    if a.host_trace:
        options.python_tracer_level, options.host_tracer_level = 1, 2
    with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True, profiler_options=options):
        start = time.perf_counter()
        traced = []
        for _ in range(a.steps):
            state, metrics = train_step(state, exp.global_batch(next(batches)))
            traced.append(metrics)
        jax.block_until_ready((state, metrics))
        step_s = (time.perf_counter() - start) / a.steps
    # What the traced steps did: their grad norms, and whether the update was speculated and
    # made again (config.offload.speculative_update).
    read = ("loss", "grad_norm", "speculated", "update_redone")
    traced = [
        {k: np.asarray(v).item() for k, v in jax.device_get(m).items() if k in read} for m in traced
    ]
    if traced and "speculated" in traced[0]:  # The exact program if every step clipped.
        program = exp.steps.program_that_ran([t["speculated"] for t in traced])
    hlo_text = program.as_text()
    trace_file = next(trace_dir.rglob("perfetto_trace.json.gz"))
    with gzip.open(trace_file) as f:
        summary = summarize(json.load(f), a.steps, hlo_text, a.top)
    t, m = config.train, exp.model_config
    tokens_per_s = t.batch_size * t.seq_len / step_s
    summary.update(
        overrides=a.overrides,
        guarded=a.guarded,
        traced_steps=traced,
        step_s=step_s,
        tokens_per_s=tokens_per_s,
        mfu=tokens_per_s * m.flops_per_token(t.seq_len) / (989e12 * jax.device_count()),
    )
    mfu = summary["mfu"]
    print(f"step {step_s * 1e3:.1f} ms (traced), {tokens_per_s:,.0f} tok/s, MFU {mfu:.3f}")
    print(f"traced steps: {traced}")
    print_summary(summary)
    out = pathlib.Path(a.out)
    write_results(str(out), [summary])
    with gzip.open(out.with_suffix(".hlo.txt.gz"), "wt") as f:
        f.write(hlo_text)
    shutil.copy(trace_file, out.with_suffix(".trace.json.gz"))
    with gzip.open(trace_file) as f:
        lines = timeline(json.load(f), *((0.5, True) if a.host_trace else ()))
        out.with_suffix(".timeline.txt").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
