"""Tokens/s and MFU of angel-jax beside the peer baselines, in one GPU job.

    python experiments/throughput.py --baselines BASELINE_DIR [--out runs/experiments/x.json]
    python experiments/throughput.py --sweep [--only NAMES] [-- --config.mesh.data=2 ...]

Each system runs in its own process (a clean GPU each), on the same shape with random tokens;
the table and the JSON give tokens/s, MFU (the baselines' formula, 989 TFLOP/s peak) and
peak memory, and each system's ratio to the plain JAX baseline.
`--child CONFIG [overrides]` is the per-variant worker for our runs. Every experiment's
child processes go through `run`: with RUN_TIMEOUT_S=N in the environment each is stopped after
N seconds and recorded as timed out, and the experiment goes on to its next run (a device
call's time limit otherwise ends the whole job, and its file, at the first slow child); with
RUN_LOG_DIR=DIR each child's stderr is kept in a file there. With TRACE_DISPATCH_MEMORY=1 a
child records the device allocator at each of an offloaded step's dispatches and at the
update's allocations between them (`trace_dispatch_memory`).
"""

import argparse
import collections
import contextlib
import datetime
import functools
import gzip
import json
import math
import os
import pathlib
import platform
import re
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]

# (name, config overrides, extra XLA flags) for our runs; the first is the default config.
VARIANTS = [
    ("angel-jax", [], ""),
    ("angel-jax remat=dots_no_batch", ["--config.model.remat=dots_no_batch"], ""),
    ("angel-jax unrolled layers", ["--config.model.scan_layers=false"], ""),
    ("angel-jax batch32", ["--config.train.batch_size=32"], ""),
]
COMBINE_256MIB = " ".join(
    f"--xla_gpu_{c}_combine_threshold_bytes=268435456"
    for c in ("all_gather", "reduce_scatter", "all_reduce")
)
PIPELINED = " ".join(
    f"--xla_gpu_enable_pipelined_{c}=true" for c in ("all_gather", "reduce_scatter", "all_reduce")
)
# Pipelined collectives (XLA's collective pipeliner moves each layer's ZeRO-3 all-gather into
# the scan's iteration before: a per-layer prefetch), the layer loop unrolled by two so the
# prefetched weights have a buffer of their own, the latency-hiding scheduler placing the
# asynchronous collectives against compute, and their stream first in line.
LATENCY_HIDING = " ".join(
    [
        PIPELINED,
        "--xla_gpu_enable_while_loop_double_buffering=true",
        "--xla_gpu_enable_latency_hiding_scheduler=true",
        "--xla_gpu_enable_highest_priority_async_stream=true",
    ]
)
# Settings tried against the default (`--sweep`): what each buys goes into the GPU configs.
SWEEP = [
    ("angel-jax", [], ""),
    ("unrolled layers", ["--config.model.scan_layers=false"], ""),
    ("triton gemm off", [], "--xla_gpu_enable_triton_gemm=false"),
    ("remat=dots", ["--config.model.remat=dots"], ""),
    ("remat=dots_no_batch", ["--config.model.remat=dots_no_batch"], ""),
    ("logits_chunks=4", ["--config.model.logits_chunks=4"], ""),
    ("command buffers off", [], "--xla_gpu_enable_command_buffer="),
    ("batch32", ["--config.train.batch_size=32"], ""),
    # On several GPUs (overrides such as -- --config.mesh.data=2 --config.zero_stage=3): the
    # collectives' combining and pipelining (flag names of the XLA in jax 0.11).
    ("collectives combined to 256 MiB", [], COMBINE_256MIB),
    ("collectives pipelined", [], PIPELINED),
]
BASELINES = [
    ("plain-jax", ["plain_jax_llama.py"]),
    ("plain-jax batch16 remat", ["plain_jax_llama.py", "--batch", "16", "--remat"]),
    ("hf-eager", ["hf_torch_llama.py"]),
    ("hf-compile", ["hf_torch_llama.py", "--compile"]),
]


def compiled_memory(program) -> dict:
    """GiB of a compiled program's memory, as XLA plans it: temporaries and arguments on the
    device, temporaries in host memory (offloaded residuals)."""
    memory = program.memory_analysis() if hasattr(program, "memory_analysis") else None
    if memory is None:
        return {}
    fields = ("temp", "argument", "output", "host_temp")
    return {f"compiled_{f}_gib": getattr(memory, f"{f}_size_in_bytes") / 2**30 for f in fields}


def child(config_path: str, overrides: list[str], steps: int, warmup: int) -> dict:
    """Times `steps` train steps of our trainer after `warmup` steps; prints one JSON line.
    steps < 0: only builds and compiles the step (the plan checked against the compiled
    program's memory, as every run is before it allocates) and reports its memory."""
    sys.path.insert(0, str(ROOT))
    import jax

    from angel_jax.config import load_config
    from angel_jax.data import make_batches
    from angel_jax.mesh import make_mesh
    from angel_jax.train import build

    # The anomaly guard off: `build` checks the step the loop runs, here the one timed.
    base = ["--config.data.synthetic=true", "--config.monitor.on_anomaly=log"]
    config = load_config(config_path, [*base, *overrides])
    compile_for = int(os.environ.get("COMPILE_FOR_DEVICES") or 0)
    if compile_for and jax.default_backend() != "gpu" and config.offload.device_gib <= 0:
        raise SystemExit(
            "COMPILE_FOR_DEVICES without a GPU: the plan's device budget is not measured here; "
            "set --config.offload.device_gib (132.81 for the H200 at "
            "XLA_PYTHON_CLIENT_MEM_FRACTION=0.95)"
        )
    devices = compile_only_devices(compile_for) if compile_for else None
    steps = -1 if compile_for else steps  # Compile-only devices run nothing.
    start = time.perf_counter()
    # An offloading plan's step may be compiled here, and the plan made again with it.
    exp = build(config, make_mesh(config.mesh, devices))
    build_s = time.perf_counter() - start
    # In the child's log: a run that fails later records only its error lines.
    print(exp.plan.table(), file=sys.stderr, flush=True)
    start = time.perf_counter()
    train_step = exp.train_step  # Compiled before the state takes the device's memory.
    # The compiled step; with the optimizer offloaded, the program `build` checks: the
    # forward/backward (the streamed update runs after it), or the whole step with the update
    # inside it (config.offload.update_in_step).
    program = exp.steps.program if exp.plan.offloads_optimizer else train_step
    plan = dict(
        plan=exp.plan.policy,
        remat=exp.model_config.remat,  # config.model.remat, or what auto picked.
        layer_inputs_on_host=exp.plan.layer_inputs_on_host,
        planned_device_gib=exp.plan.tier_bytes("device") / 2**30,
        planned_host_gib=exp.plan.tier_bytes("pinned_host") / 2**30,
        planned={s: b / 2**30 for s, b in exp.plan.state_bytes.items()},
        resident_chunks=len(exp.plan.resident),
        copies_beside_step=exp.plan.copies_beside_step,
        # The delayed update between microbatches: its groups' bytes (0: after the step).
        slot_gib=exp.plan.slot_bytes / 2**30,
        hybrid_update=exp.plan.cpu_note,
        # The masters' low halves beside the compute copy (config.offload.split_masters), and
        # the bytes the device's update moves each way a step, from the chunks' dtypes.
        split_masters=exp.plan.split_masters,
        update_gb_each_way=_moved_bytes(exp) / 1e9 if exp.plan.offloads_optimizer else 0,
        build_s=build_s,
        compile_s=time.perf_counter() - start,
        **compiled_memory(program),
    )
    if getattr(exp.steps, "between_microbatches", False):  # The step's last program too.
        finish = exp.steps.finish_program.memory_analysis()
        plan["finish_temp_gib"] = finish.temp_size_in_bytes / 2**30
        update = exp.streamed_update
        beside = min(update.between_groups, config.train.microbatches - 1)
        plan["update_groups_gib"] = {
            "beside the microbatches": [n / 2**30 for n in update.moved_bytes[:beside]],
            "after the last": [n / 2**30 for n in update.moved_bytes[beside:]],
        }
    if steps < 0:
        t = config.train
        compiled = program_report(program, overrides)
        if compile_for:
            compiled["compiled_for_devices"] = compile_for
            compiled["compiled_for"] = devices[0].device_kind
        return dict(fits=True, batch=t.batch_size, seq=t.seq_len, **plan, **compiled)
    traced = []  # The allocator at each dispatch, with TRACE_DISPATCH_MEMORY.
    tracing = (
        trace_dispatch_memory(exp, traced) if os.environ.get("TRACE_DISPATCH_MEMORY") else None
    )
    with tracing or contextlib.nullcontext():
        state = exp.init_state()
        batches = make_batches(config).iterate(0)
        warmup_losses = []  # Same data every run: lets variants be checked against each other.
        for _ in range(warmup):
            state, metrics = train_step(state, exp.global_batch(next(batches)))
            warmup_losses.append(float(metrics["loss"]))
        start = time.perf_counter()
        # When each step's call returned (host time, device work not waited for): a step that
        # stalls the host (a pinned-pool growth, a blocked dispatch) stands out among them.
        returned_s, redone, speculated = [], [], []
        for _ in range(steps):
            state, metrics = train_step(state, exp.global_batch(next(batches)))
            returned_s.append(time.perf_counter() - start)
            if "update_redone" in metrics:  # config.offload.speculative_update: made again?
                redone.append(int(metrics["update_redone"]))
                speculated.append(int(metrics["speculated"]))
        jax.block_until_ready((state, metrics))
        step_s = (time.perf_counter() - start) / max(steps, 1)
        try:
            breakdown = offload_breakdown(exp, state, exp.global_batch(next(batches)))
        except jax.errors.JaxRuntimeError as e:  # The timed steps stand; the step after them not.
            if steps == 0:
                raise
            breakdown = {"breakdown_error": str(e).splitlines()[0]}
    if speculated:  # The speculative update: the exact program if every step clipped.
        program = exp.steps.program_that_ran(speculated)
    compiled = program_report(program, overrides)
    if steps == 0:  # The broken-down step is the timed one.
        step_s = breakdown["compute_s"] + breakdown["update_s"]
    loss = float(metrics["loss"])
    t, m = config.train, exp.model_config
    tokens_per_s = t.batch_size * t.seq_len / step_s
    stats = jax.devices()[0].memory_stats() or {}
    return dict(
        step_s=step_s,
        tokens_per_s=tokens_per_s,
        mfu=tokens_per_s * m.flops_per_token(t.seq_len) / (989e12 * jax.device_count()),
        loss=loss,
        warmup_losses=warmup_losses,
        step_returned_s=returned_s,
        **({"updates_redone": redone, "steps_speculated": speculated} if redone else {}),
        **plan,
        peak_gib=stats.get("peak_bytes_in_use", 0) / 2**30,
        batch=t.batch_size,
        seq=t.seq_len,
        **compiled,  # Kernels, collectives and their schedule.
        **breakdown,
        **({"dispatch_memory": summarize_dispatch_memory(traced)} if traced else {}),
    )


def most_copies_open(hlo_text: str) -> int:
    """The most asynchronous copies (copy-start without its copy-done yet) that a compiled
    program's schedule keeps open at once, over its entry computation in order."""
    entry = re.search(r"^ENTRY .*?^\}", hlo_text, re.M | re.S)
    open_now = most = 0
    for line in entry.group(0).splitlines() if entry else []:
        if " copy-start(" in line:
            open_now += 1
            most = max(most, open_now)
        elif " copy-done(" in line:
            open_now -= 1
    return most


def program_report(program, overrides: list[str]) -> dict:
    """What a compiled step holds: its kernels, its collectives' bytes and how XLA scheduled
    them; its HLO text is written to THROUGHPUT_HLO_DIR when set (for reading them later)."""
    if not hasattr(program, "as_text"):  # The guarded step: a function around a program.
        return {}
    text = program.as_text()
    if os.environ.get("THROUGHPUT_HLO_DIR"):
        name = re.sub(r"[^A-Za-z0-9]+", "_", " ".join(overrides))[-120:]
        path = pathlib.Path(os.environ["THROUGHPUT_HLO_DIR"]) / f"{name}.hlo.txt.gz"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(gzip.compress(text.encode()))
    return dict(
        kernels=custom_calls(text),
        # Host<->device copies inside the program: asynchronous (copy-start) or not.
        host_copies={
            **{op: text.count(f" {op}(") for op in ("copy-start", "copy-done")},
            "most open": most_copies_open(text),
        },
        collectives=collective_bytes(text),
        collective_schedule=collective_schedule(text),
    )


def compile_only_devices(n: int) -> list:
    """n of JAX's compile-only devices of one host's GPUs (a described topology): a program
    for n GPUs compiles here from shapes, and nothing of it runs. On a GPU machine they are of
    its GPU's kind. On one without a GPU they are of the kind GPU_TARGET_CONFIG describes (an
    XLA GPU target description, e.g. experiments/gpu_targets/h200.txtpb; JAX's CUDA plugin
    installed, JAX_PLATFORMS=cpu), and the trainer plans and picks kernels as on that GPU
    (`angel_jax.machine.describe`), with GPU_HOST_GIB of host memory (the GPU machine's; the
    device's budget is config.offload.device_gib)."""
    import jax
    from jax.experimental import topologies

    target = os.environ.get("GPU_TARGET_CONFIG")
    described = {}
    if jax.default_backend() != "gpu":
        if not target:
            raise SystemExit(
                f"COMPILE_FOR_DEVICES={n}: compile-only devices are described for CUDA GPUs, and "
                f"this backend is {jax.default_backend()}: run it on a GPU machine, or set "
                "GPU_TARGET_CONFIG to a GPU's target description (experiments/gpu_targets/)"
            )
        from angel_jax import machine

        host_gib = float(os.environ.get("GPU_HOST_GIB") or 0)
        if host_gib <= 0:
            raise SystemExit(
                "GPU_TARGET_CONFIG: set GPU_HOST_GIB to the GPU machine's available host memory "
                "(GiB; about 120 on the H200 machine), else the plan takes this machine's"
            )
        described["target_config"] = pathlib.Path(target).read_text()
        # The programs are for that GPU, with its kernels.
        capability = machine.target_capability(described["target_config"])
        machine.describe("gpu", int(host_gib * 2**30), capability=capability)
    topology = topologies.get_topology_desc(
        "compile-only", "cuda", topology=f"1x1x{n}", **described
    )
    return topology.devices


def timed(fn, *args, reps=10) -> float:
    """Seconds per call of `fn(*args)` after one warm-up call (compilation), device work
    waited for."""
    import jax

    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    for _ in range(reps):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / reps


def custom_calls(hlo_text: str) -> dict:
    """Custom-call targets of a compiled program (its HLO text) with counts: which kernels
    (cuBLAS, cuDNN, Mosaic GPU, ...) it runs."""
    return dict(collections.Counter(re.findall(r'custom_call_target="([^"]+)"', hlo_text)))


COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")


def _hlo_bytes(dtype: str, dims: str) -> float:
    """Bytes of an HLO array: its element type's bits are in its name (bf16, f8e4m3fn, s32)."""
    bits = re.match(r"\D*(\d+)", dtype)
    size = 8 if dtype == "pred" else int(bits.group(1)) if bits else 0
    return size / 8 * math.prod(int(d) for d in dims.split(",") if d)


def _hlo_graph(hlo_text: str):
    """(entry computation, {computation: [(callees, trips, a loop's body)]}, {computation:
    [instruction lines]}) of a compiled program's HLO text: each call with the computations it
    may run (a conditional's branches, one of which runs) and the trip count of the loop
    making it (XLA's known_trip_count), and each computation's instructions."""
    calls: dict[str, list] = collections.defaultdict(list)
    lines: dict[str, list] = collections.defaultdict(list)
    entry, name = None, None
    for line in hlo_text.splitlines():
        header = re.match(r"(ENTRY )?%(\S+) \(.*\{$", line)
        if header:
            name = header.group(2)
            entry = name if header.group(1) else entry
            continue
        if name is None or " = " not in line:
            continue
        lines[name].append(line)
        # An async op's start, update and done all name the computation it runs: one call.
        if not re.search(r" async-(done|update)\(", line):
            trips = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', line)
            n = int(trips.group(1)) if trips else 1
            for kind, callee in re.findall(r"\b(body|calls)=%([\w.\-]+)", line):
                calls[name].append(((callee,), n, kind == "body"))
            branches = re.search(r"branch_computations=\{([^}]*)\}", line)
            if branches:
                calls[name].append((tuple(re.findall(r"%([\w.\-]+)", branches.group(1))), n, False))
    return entry, calls, lines


def _visits(entry, calls) -> dict[str, tuple[int, bool]]:
    """Per computation reached from `entry`: (times it is reached in one run of the program,
    each of a conditional's branches as if it ran; whether a loop's body runs it)."""
    seen: dict[str, tuple[int, bool]] = {}

    def visit(computation: str, times: int, in_loop: bool) -> None:
        before = seen.get(computation, (0, False))
        seen[computation] = (before[0] + times, before[1] or in_loop)
        for callees, trips, body in calls[computation]:
            for callee in callees:
                visit(callee, times * trips, in_loop or body)

    if entry:
        visit(entry, 1, False)
    return seen


def collective_bytes(hlo_text: str) -> dict:
    """{collective: [count, bytes]} that a compiled program's collectives produce per device in
    one run: each op's result (a gather's gathered array, a reduce-scatter's shard, an
    all-reduce's buffer; asynchronous ones at their -done, or once inside the computation an
    async-start calls), times the trip counts of the loops around it (XLA's
    known_trip_count), so a scan over layers counts each layer's gather; of a conditional's
    branches, one runs: the most any branch produces. On the wire each device sends about
    (n-1)/n of a gather's result, n-1 reduce-scatter shards and 2(n-1)/n of an all-reduce's
    buffer."""
    entry, calls, lines = _hlo_graph(hlo_text)

    @functools.cache
    def produced(computation: str) -> dict[str, tuple[float, float]]:
        """{collective: (count, bytes)} of one run of `computation`."""
        out: dict[str, list] = {}

        def add(part: dict, times: int) -> None:
            for kind, (n, size) in part.items():
                count = out.setdefault(kind, [0, 0])
                count[0] += times * n
                count[1] += times * size

        for line in lines[computation]:
            op = re.search(r" = (.*?) (" + "|".join(COLLECTIVES) + r")(-done)?\(", line)
            if op:
                shapes = re.findall(r"(\w+)\[([\d,]*)\]", op.group(1))
                add({op.group(2): (1, sum(_hlo_bytes(t, d) for t, d in shapes))}, 1)
        for callees, trips, _ in calls[computation]:
            parts = [produced(c) for c in callees]
            kinds = set().union(*parts)
            most = {
                k: tuple(max(p.get(k, (0, 0))[i] for p in parts) for i in (0, 1)) for k in kinds
            }
            add(most, trips)
        return {k: tuple(v) for k, v in out.items()}

    return {k: list(v) for k, v in produced(entry).items()} if entry else {}


def collective_schedule(hlo_text: str) -> dict:
    """{collective: {ops, sync, pipelined, in_loop}} of a compiled program: its collective ops
    (each once, however often it runs; an asynchronous one at its start), how many XLA's
    scheduler left synchronous (`is_sync`: nothing placed beside it), how many its collective
    pipeliner moved to a loop iteration before or after their use (`is_pipelined`), and how
    many sit inside a loop (a scan over layers). Read from each op's backend config."""
    entry, calls, lines = _hlo_graph(hlo_text)
    out: dict[str, dict] = {}
    for computation, (_, in_loop) in _visits(entry, calls).items():
        for line in lines[computation]:
            op = re.search(r" (" + "|".join(COLLECTIVES) + r")(-start)?\(", line)
            if not op:
                continue
            count = out.setdefault(op.group(1), dict(ops=0, sync=0, pipelined=0, in_loop=0))
            count["ops"] += 1
            count["sync"] += '"is_sync":true' in line
            count["pipelined"] += '"is_pipelined":true' in line
            count["in_loop"] += in_loop
    return out


def trace_dispatch_memory(exp, out: list) -> contextlib.AbstractContextManager:
    """Inside it, (point, bytes in use, largest free block) of the device allocator are
    appended to `out` at each of an offloaded step's dispatches (a microbatch's program, a
    group of the streamed update: `angel_jax.dispatch`) and after each group's fetch (the
    update's allocations between them are those and its programs' outputs); each also printed
    to stderr as it comes, so that a run that dies out of memory leaves them in its log. The
    allocator's view at a dispatch is the host's (PJRT allocates then, and frees a program's
    temporaries as soon as it is queued): a microbatch's temporaries need one block of their
    size, so a largest free block below them with the bytes in use within the plan is a
    fragmented pool, not a plan overrun, and a fetch after which the largest free block shrank
    took its arrays from the block the temporaries left."""
    from angel_jax import dispatch

    device = exp.mesh.devices.flat[0]

    def record(point):
        stats = device.memory_stats() or {}
        row = (point, stats.get("bytes_in_use", 0), stats.get("largest_free_block_bytes", 0))
        out.append(row)
        used, free = (f"{b / 2**30:.2f} GiB" for b in row[1:])
        print(f"allocator at {point}: in use {used}, largest free block {free}", file=sys.stderr)

    return dispatch.listening(record)


def summarize_dispatch_memory(traced: list) -> dict:
    """Per program name: the most bytes in use and the smallest largest free block at its
    dispatches, GiB."""
    out = {}
    for name, used, free in traced:
        row = out.setdefault(name, {"dispatches": 0, "most_in_use_gib": 0.0})
        row["dispatches"] += 1
        row["most_in_use_gib"] = max(row["most_in_use_gib"], used / 2**30)
        row["least_largest_free_gib"] = min(
            row.get("least_largest_free_gib", math.inf), free / 2**30
        )
    return out


def offload_breakdown(exp, state, batch) -> dict:
    """One more step of an offloaded run, its two parts timed on their own: the jitted
    forward/backward, and the streamed update with the bytes it copies each way. Of an update
    between microbatches only the forward/backward: run on its own, after the step, the
    update's groups need programs the timed steps did not compile (on the H200 the 8B's took
    18.3 s with them compiled inside), and run twice to time them warm it ran the device out
    of memory (a microbatch's 37.5 GiB after an update the training never runs so)."""
    import jax

    from angel_jax import sharding

    if not exp.plan.offloads_optimizer or exp.config.offload.update_in_step:
        return {}  # On the device, or one program with the update inside.
    jax.block_until_ready(state)
    cpu = exp.offloaded.cpu
    if cpu:
        cpu.seconds.clear()
    with sharding.use_rules(exp.mesh, exp.rules):
        start = time.perf_counter()
        step, grads, scale, metrics = exp.steps.grad_step(state.step, state.compute_params, batch)
        jax.block_until_ready((grads, metrics))
        middle = time.perf_counter()
        if getattr(exp.steps, "between_microbatches", False):
            return dict(compute_s=middle - start)
        jax.block_until_ready(exp.steps.apply(state, step, grads, scale))
        end = time.perf_counter()
    moved = _moved_bytes(exp)
    return dict(
        compute_s=middle - start,
        update_s=end - middle,
        update_gbps_each_way=moved / 1e9 / (end - middle),
        **({"cpu_update_seconds": dict(cpu.seconds)} if cpu else {}),
    )


def _moved_bytes(exp) -> int:
    """The bytes the device's update moves each way a step: its host-memory chunks'."""
    import jax

    from angel_jax.planning.tiers import HOST

    return sum(
        x.size * x.dtype.itemsize
        for c in exp.streamed_update.chunks
        if c.tier == HOST
        for x in jax.tree.leaves((c.master, c.state))
    )


def run_ours(
    config: str, overrides: list[str], steps: int, warmup: int, xla_flags="", env=None
) -> dict:
    """Times our trainer on `config` with `overrides` in a fresh process (see `child`), with
    `xla_flags` added to XLA_FLAGS and `env` to the environment."""
    cmd = [sys.executable, str(ROOT / "experiments/throughput.py"), "--config", config]
    cmd += ["--steps", str(steps), "--warmup", str(warmup), "--child", *overrides]
    env = {**os.environ, **(env or {})}
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {xla_flags}".strip()
    return run(cmd, ROOT, env=env)


def run(cmd: list[str], cwd, log: str | None = None, env: dict | None = None) -> dict:
    """The last JSON line `cmd` prints, or its exit code and last lines; `log` keeps all of its
    stderr, written as it comes (a run killed from outside leaves it; with RUN_LOG_DIR set and
    no `log`, a numbered file there, named in the result). RUN_TIMEOUT_S (seconds, 0 or unset:
    none) limits it."""
    limit = float(os.environ.get("RUN_TIMEOUT_S") or 0) or None
    if log is None and os.environ.get("RUN_LOG_DIR"):
        logs = pathlib.Path(os.environ["RUN_LOG_DIR"])
        taken = [int(p.stem.split("_")[1]) for p in logs.glob("child_*.log")]
        log = str(logs / f"child_{max(taken, default=-1) + 1:02d}.log")
    named = {"log": log} if log else {}
    if log:
        pathlib.Path(log).parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w+") if log else tempfile.TemporaryFile("w+") as f:
        try:
            proc = subprocess.run(
                cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=f, text=True, env=env, timeout=limit
            )
        except subprocess.TimeoutExpired:
            proc = None
        f.seek(0)
        stderr = f.read()
    if proc is None:
        tail = stderr.strip().splitlines()[-3:]
        return dict(error=[f"timed out after {limit:.0f} s (RUN_TIMEOUT_S)", *tail], **named)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        output = (stderr or proc.stdout).strip().splitlines()
        # The error's own lines (a traceback's last lines may be XLA's op locations only).
        errors = [line for line in output if "Error" in line or "error:" in line][-3:]
        return dict(error=[f"exit code {proc.returncode}", *errors, *output[-5:]], **named)
    return {**json.loads(lines[-1]), **named}


def machine() -> dict:
    import jax

    return dict(
        device=jax.devices()[0].device_kind,
        device_count=jax.device_count(),
        host=platform.node(),
        python=platform.python_version(),
        jax=jax.__version__,
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        env={
            k: v
            for k, v in os.environ.items()
            if k.startswith(("XLA_", "JAX_", "TF_", "MALLOC_", "GPU_", "COMPILE_FOR_", "TRACE_"))
        },
    )


def write_results(path: str, results: list[dict]) -> None:
    """Writes the results with the command and machine that produced them."""
    out = pathlib.Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = dict(command=" ".join(sys.argv), machine=machine(), results=results)
    out.write_text(json.dumps(record, indent=1))
    print(f"wrote {out}")


def print_table(results: list[dict]) -> None:
    """tokens/s, MFU and peak memory per system, and its tokens/s over each baseline's (the
    baselines' default-shape runs: plain-jax, hf-eager, hf-compile; with none, the first run)."""
    names = ("plain-jax", "hf-eager", "hf-compile")
    bases = {r["system"]: r for r in results if r["system"] in names and "tokens_per_s" in r}
    if not bases and results and "tokens_per_s" in results[0]:  # A sweep: against the first.
        bases = {results[0]["system"]: results[0]}
    header = ("system", "batch", "tokens/s", "MFU", "peak GiB", *(f"vs {n}" for n in bases))
    print("\n{:<40} {:>5} {:>10} {:>7} {:>9}".format(*header[:5]), *header[5:], sep="  ")
    for r in results:
        if "tokens_per_s" not in r:
            print(f"{r['system']:<40} failed: {r.get('error')}")
            continue
        batch = r.get("batch") or r.get("shape", {}).get("batch")
        peak = f"{r['peak_gib']:.1f}" if "peak_gib" in r else "-"
        tps, mfu = f"{r['tokens_per_s']:,.0f}", f"{r['mfu']:.3f}"
        ratios = [
            f"{r['tokens_per_s'] / b['tokens_per_s']:>{len(n) + 3}.3f}" for n, b in bases.items()
        ]
        print(f"{r['system']:<40} {batch:>5} {tps:>10} {mfu:>7} {peak:>9}", *ratios, sep="  ")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", default=str(ROOT / "configs/llama_1b.py"))
    p.add_argument("--baselines", help="directory holding the peer baselines (plain_jax_llama.py)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--only", default="", help="comma-separated variant names to run")
    p.add_argument("--sweep", action="store_true", help="run the SWEEP settings, no baselines")
    p.add_argument("--out", default=str(ROOT / "runs/experiments/throughput_llama_1b.json"))
    p.add_argument("--child", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help="config overrides for every run of ours, after --")
    args = p.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.config, args.child, args.steps, args.warmup)), flush=True)
        return 0

    results = []
    only = set(filter(None, args.only.split(",")))
    for name, overrides, xla_flags in SWEEP if args.sweep else VARIANTS:
        if only and name not in only:
            continue
        overrides = [*overrides, *args.overrides]
        timing = run_ours(args.config, overrides, args.steps, args.warmup, xla_flags)
        results.append({**timing, "system": name, "overrides": overrides, "xla_flags": xla_flags})
        print(json.dumps(results[-1]), flush=True)
        write_results(args.out, results)  # So far: a run cut short keeps what it measured.
    if args.baselines and not args.sweep:
        for name, cmd in BASELINES:
            if only and name not in only:
                continue
            full = [sys.executable, *cmd, "--steps", str(args.steps)]
            results.append({**run(full, args.baselines), "system": name, "command": " ".join(cmd)})
            print(json.dumps(results[-1]), flush=True)

    print_table(results)
    write_results(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
