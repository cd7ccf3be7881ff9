"""The benchmarks' shared child runner (experiments/throughput.py `run`), and their parts that
run on the CPU."""

import collections
import json
import os
import pathlib
import re
import subprocess
import sys
import threading
import time

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "experiments"))

import throughput  # noqa: E402


def test_a_child_past_run_timeout_is_recorded_and_the_caller_goes_on(monkeypatch, tmp_path):
    monkeypatch.setenv("RUN_TIMEOUT_S", "1")
    code = "import sys, time; print('begun', file=sys.stderr, flush=True); time.sleep(30)"
    slow = [sys.executable, "-c", code]
    log = tmp_path / "child.log"
    result = throughput.run(slow, tmp_path, str(log))
    assert result["error"][0] == "timed out after 1 s (RUN_TIMEOUT_S)", result
    assert "begun" in log.read_text()
    quick = [sys.executable, "-c", "print('{\"tokens_per_s\": 1}')"]
    assert throughput.run(quick, tmp_path) == {"tokens_per_s": 1}


def test_a_childs_log_is_written_while_it_runs(tmp_path):
    """A runner killed from outside (a job's time limit) leaves what its child printed."""
    log = tmp_path / "child.log"
    code = "import sys, time; print('begun', file=sys.stderr, flush=True); time.sleep(3)"
    runner = threading.Thread(
        target=throughput.run, args=([sys.executable, "-c", code], tmp_path, str(log))
    )
    runner.start()
    deadline = time.monotonic() + 2.5
    while time.monotonic() < deadline and not (log.exists() and "begun" in log.read_text()):
        time.sleep(0.05)
    assert runner.is_alive() and "begun" in log.read_text()
    runner.join()


def test_the_timeline_merges_runs_of_work_and_keeps_long_host_calls():
    import profile_step

    def meta(pid, name, tid=None):
        kind = "process_name" if tid is None else "thread_name"
        return {"name": kind, "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}}

    def x(pid, tid, name, ts, dur, **args):
        return {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts, "dur": dur, "args": args}

    trace = {
        "traceEvents": [
            meta(1, "/device:GPU:0"),
            meta(1, "Stream #1(Compute)", 1),
            meta(1, "Stream #2(MemcpyH2D)", 2),
            meta(2, "/host:CPU"),
            meta(2, "python", 7),
            # Two kernels of one program 10 us apart: one run. A second program: another.
            x(1, 1, "fusion", 0, 100, hlo_module="grad"),
            x(1, 1, "gemm", 110, 100, hlo_module="grad"),
            x(1, 1, "fusion", 300, 50, hlo_module="update"),
            x(1, 2, "MemcpyH2D", 50, 20),
            x(1, 2, "MemcpyH2D", 90, 30),
            x(2, 7, "cuMemHostAlloc", 0, 5000, memalloc_details="31 GiB"),
            x(2, 7, "cuMemHostAlloc", 0, 10),  # Under min_host_ms: left out.
            x(2, 7, "$stream.py:233 __call__", 0, 3000),  # A Python call: with every event.
        ]
    }
    lines = profile_step.timeline(trace, min_host_ms=1.0)
    assert len(lines) == 4, lines
    every = profile_step.timeline(trace, min_host_ms=1.0, every_host_event=True)
    assert len(every) == 5 and any("stream.py:233 __call__" in line for line in every), every

    def duration_ms(what):
        return float(next(line for line in lines if what in line).split()[2])

    assert duration_ms("grad x2") == 0.21 and duration_ms("update x1") == 0.05, lines
    assert duration_ms("host->device x2") == 0.07, lines
    assert duration_ms("cuMemHostAlloc 31 GiB") == 5.0, lines


def test_the_summary_counts_copies_during_the_backward_pass():
    """A forward kernel, then the backward pass: two kernels from transposed JAX ops with a
    kernel of no known op (a command buffer's) between them; a host-to-device copy from the
    forward kernel's middle to the unknown kernel's: 2.5 of its 3 ms during the backward."""
    import profile_step

    def x(pid, tid, name, ts, dur, **args):
        return {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts, "dur": dur, "args": args}

    trace = {
        "traceEvents": [
            {"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "/device:GPU:0"}},
            {"name": "thread_name", "ph": "M", "pid": 1, "tid": 1, "args": {"name": "Compute"}},
            {"name": "thread_name", "ph": "M", "pid": 1, "tid": 2, "args": {"name": "H2D"}},
            x(1, 1, "loop_fusion", 0, 1000, hlo_op="fusion.1"),
            x(1, 1, "gemm", 1000, 1000, hlo_op="dot.2"),
            x(1, 1, "nvjet_gemm", 2000, 1000, hlo_op="command_buffer_3"),
            x(1, 1, "loop_fusion_4", 3000, 1000, hlo_op="command_buffer_3"),
            x(1, 2, "MemcpyH2D", 500, 3000),
        ]
    }
    hlo = (
        '  %fusion.1 = f32[8]{0} fusion(%p), metadata={op_name="jit(step)/jvp(layer)/mul"}\n'
        '  %dot.2 = f32[8]{0} dot(%a, %b), metadata={op_name="jit(step)/transpose(jvp('
        'layer))/dot_general"}\n'
        '  ROOT %loop_fusion.4 = f32[8]{0} fusion(%a), metadata={op_name="jit(step)/transpose(jvp('
        'layer))/mul"}\n'
    )
    g = profile_step.summarize(trace, steps=1, hlo_text=hlo, top=5)["gpus"]["/device:GPU:0"]
    assert g["copy_ms_per_step"] == 3.0 and g["backward_ms_per_step"] == 3.0, g
    assert g["copy_during_backward_ms_per_step"] == 2.5, g


def test_most_copies_open_follows_the_entry_computations_schedule():
    hlo = """HloModule m

%fused (p: f32[4]) -> f32[4] {
  %a = f32[4]{0} copy-start(%p)
  %b = f32[4]{0} copy-start(%p)
  %c = f32[4]{0} copy-start(%p)
}

ENTRY %main (p: f32[4]) -> f32[4] {
  %cs.1 = (f32[4]{0:S(5)}, f32[4]{0}, u32[]) copy-start(%p)
  %cs.2 = (f32[4]{0:S(5)}, f32[4]{0}, u32[]) copy-start(%p)
  %cd.1 = f32[4]{0:S(5)} copy-done(%cs.1)
  %cs.3 = (f32[4]{0:S(5)}, f32[4]{0}, u32[]) copy-start(%p)
  %cd.2 = f32[4]{0:S(5)} copy-done(%cs.2)
  ROOT %cd.3 = f32[4]{0:S(5)} copy-done(%cs.3)
}
"""
    assert throughput.most_copies_open(hlo) == 2


def test_collective_bytes_count_each_trip_of_a_scan():
    """A scan over 4 layers gathering each layer's (256, 128) bf16 weight split over 2 devices:
    4 gathers of 256 x 128 values in the forward (XLA:CPU gathers them in float32), and the
    backward's, each counted once per trip."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((2,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[:2])
    w = jax.ShapeDtypeStruct(
        (4, 256, 128), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "data"))
    )
    x = jax.ShapeDtypeStruct((8, 256), jnp.bfloat16, sharding=NamedSharding(mesh, P("data")))

    def loss(w, x):
        def layer(h, w_l):
            w_l = jax.lax.with_sharding_constraint(w_l, NamedSharding(mesh, P()))
            return jnp.tanh(h @ w_l @ w_l.T), None

        h, _ = jax.lax.scan(layer, x, w)
        return jnp.sum(h.astype(jnp.float32))

    forward = throughput.collective_bytes(jax.jit(loss).lower(w, x).compile().as_text())
    # And the loss's float32 sum over the two devices' rows, outside the scan.
    assert forward == {"all-gather": [4, 4 * 256 * 128 * 4], "all-reduce": [1, 4]}
    both = throughput.collective_bytes(jax.jit(jax.grad(loss)).lower(w, x).compile().as_text())
    assert both["all-gather"][0] == 4 and sum(n for n, _ in both.values()) > 4
    assert all(n % 4 == 0 for n, _ in both.values())  # Every collective sits in a scan.


def test_collective_bytes_count_an_async_collective_once():
    """XLA:GPU runs a reduce-scatter as an async-start and an async-done that both name the
    computation holding it: it is counted once, and an all-gather at its -done, not its
    -start (whose result holds the input beside the output)."""
    hlo = """
%wrapped (p: bf16[8,4]) -> bf16[4,4] {
  %rs = bf16[4,4]{1,0} reduce-scatter(bf16[8,4]{1,0} %p), dimensions={0}, to_apply=%add
}

ENTRY %main (a: bf16[8,4], b: f8e4m3fn[2,4]) -> bf16[4,4] {
  %start = ((bf16[8,4]), bf16[4,4]) async-start(bf16[8,4]{1,0} %a), calls=%wrapped
  %done = bf16[4,4]{1,0} async-done(((bf16[8,4]), bf16[4,4]) %start), calls=%wrapped
  %ag = (f8e4m3fn[2,4]{1,0}, f8e4m3fn[4,4]{1,0}) all-gather-start(f8e4m3fn[2,4]{1,0} %b)
  %agd = f8e4m3fn[4,4]{1,0} all-gather-done((f8e4m3fn[2,4]{1,0}, f8e4m3fn[4,4]{1,0}) %ag)
}
"""
    counts = throughput.collective_bytes(hlo)
    assert counts == {"reduce-scatter": [1, 4 * 4 * 2], "all-gather": [1, 4 * 4]}


def test_a_conditional_counts_its_branch_that_produces_the_most():
    """Of a conditional's branches one runs: bytes are the most any branch produces, and the
    schedule lists every branch's ops."""
    hlo = "\n".join(
        [
            "%b0 (p: bf16[2,4]) -> bf16[4,4] {",
            "  %ag0 = bf16[4,4]{1,0} all-gather(bf16[2,4]{1,0} %p), dimensions={0}",
            "}",
            "%b1 (p: bf16[2,4]) -> bf16[8,4] {",
            "  %ag1 = bf16[8,4]{1,0} all-gather(bf16[2,4]{1,0} %p), dimensions={0}",
            "  %cp = bf16[2,4]{1,0} collective-permute(bf16[2,4]{1,0} %p)",
            "}",
            "ENTRY %main (i: s32[], a: bf16[2,4]) -> bf16[4,4] {",
            "  %c = bf16[4,4]{1,0} conditional(s32[] %i, bf16[2,4]{1,0} %a, bf16[2,4]{1,0} %a), "
            "branch_computations={%b0, %b1}",
            "}",
        ]
    )
    assert throughput.collective_bytes(hlo) == {
        "all-gather": [1, 8 * 4 * 2],
        "collective-permute": [1, 2 * 4 * 2],
    }
    schedule = throughput.collective_schedule(hlo)
    assert schedule["all-gather"]["ops"] == 2 and schedule["collective-permute"]["ops"] == 1


def test_collective_schedule_reads_how_xla_placed_each_collective():
    """Each collective op once (an async one at its start), with the flags XLA's scheduler
    and collective pipeliner leave in its backend config, and whether a loop's body holds it
    (however deep: the body's own calls too)."""

    def config(sync: str, pipelined: str) -> str:
        flags = f'"is_sync":{sync},"is_pipelined":{pipelined}'
        return 'backend_config={"collective_backend_config":{' + flags + "}}"

    gather = "(bf16[2,4]{1,0}, bf16[4,4]{1,0})"
    hlo = "\n".join(
        [
            "%inner (p: bf16[2,4]) -> bf16[4,4] {",
            f"  %ag = {gather} all-gather-start(bf16[2,4]{{1,0}} %p), {config('false', 'true')}",
            f"  %agd = bf16[4,4]{{1,0}} all-gather-done({gather} %ag)",
            "}",
            "%body (c: bf16[2,4]) -> bf16[2,4] {",
            "  %f = bf16[4,4]{1,0} fusion(bf16[2,4]{1,0} %c), kind=kLoop, calls=%inner",
            "}",
            "ENTRY %main (a: bf16[2,4], b: f32[4]) -> f32[4] {",
            "  %w = bf16[2,4]{1,0} while(bf16[2,4]{1,0} %a), condition=%cond, body=%body",
            f"  %ar = f32[4]{{0}} all-reduce(f32[4]{{0}} %b), {config('true', 'false')}",
            "}",
        ]
    )
    assert throughput.collective_schedule(hlo) == {
        "all-gather": dict(ops=1, sync=0, pipelined=1, in_loop=1),
        "all-reduce": dict(ops=1, sync=1, pipelined=0, in_loop=0),
    }


def test_every_xla_setting_the_benchmarks_try_is_a_flag_of_this_xla():
    """XLA renames and drops flags between releases, and an unknown one in XLA_FLAGS aborts the
    process: each setting `scaling.py --collectives` and `throughput.py --sweep` try starts a
    JAX process here (the GPU flags are parsed on the CPU too)."""
    import os
    import subprocess

    import scaling

    flags = {
        f
        for s in [*scaling.COLLECTIVES.values(), *(v[2] for v in throughput.SWEEP)]
        for f in s.split()
    }
    assert any("latency_hiding" in f for f in flags)
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=" ".join(sorted(flags)))
    code = "import jax.numpy as jnp; print(float(jnp.ones(2).sum()))"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip() == "2.0", proc.stderr[-2000:]


def test_the_two_gpu_runs_compiled_on_fewer_gpus_are_issue_25s_and_valid_configs():
    """`two_gpu_compiled.py` covers each of `two_gpu.sh`'s runs with settings the trainer
    accepts; its compile-only devices are refused with a clear message where there is no GPU."""
    import two_gpu_compiled

    from angel_jax.config import load_config, validate

    runs = two_gpu_compiled.runs()
    script = (throughput.ROOT / "experiments/two_gpu.sh").read_text()
    assert {r[0] for r in runs} == set(re.findall(r"^(\w+)\)$", script, re.M)) - {"setup"}
    steps = lambda runs: {(r[2], tuple(r[3]), r[4]) for r in runs}
    for label in {r[0] for r in runs}:  # A run alone compiles all its steps.
        assert steps(two_gpu_compiled.selected(label)) == steps(r for r in runs if r[0] == label)
    everything = two_gpu_compiled.selected("")
    assert len(everything) == len(steps(runs)) == len({r[1] for r in everything})
    for _, _, config, overrides, _ in runs:
        validate(load_config(config, overrides))  # As `build` checks it in the child.
    with pytest.raises(SystemExit, match="COMPILE_FOR_DEVICES=2: compile-only devices"):
        throughput.compile_only_devices(2)


def test_the_fused_update_probe_checks_its_programs_against_their_parts(tmp_path, monkeypatch):
    """The probe's fused programs (scanned and unrolled, the update beside the backward pass)
    agree with their parts run one after the other; its GPU figures rest on that."""
    import fused_update_probe

    out = tmp_path / "probe.json"
    args = "--layers 2 --d 64 --ffn 128 --tokens 32 --reps 1 --out".split()
    monkeypatch.setattr(sys, "argv", ["fused_update_probe.py", *args, str(out)])
    assert fused_update_probe.main() == 0
    systems = [r["system"] for r in json.loads(out.read_text())["results"]]
    assert "update beside the backward pass, unrolled layers" in systems


def test_a_step_compiles_for_a_described_gpu_on_a_machine_without_one(tmp_path):
    """COMPILE_FOR_DEVICES with GPU_TARGET_CONFIG: the trainer plans and compiles its step for
    the H200 that experiments/gpu_targets/h200.txtpb describes, with the GPU's kernels (cuDNN
    attention), on a machine without a GPU. Needs JAX's CUDA plugin (not in the test
    requirements: about 3 GB of NVIDIA libraries), where it runs; skipped elsewhere."""
    pytest.importorskip("jax_plugins.xla_cuda13", reason="JAX's CUDA plugin is not installed")
    root = pathlib.Path(throughput.ROOT)
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("XLA_")},
        "COMPILE_FOR_DEVICES": "1",
        "GPU_TARGET_CONFIG": str(root / "experiments/gpu_targets/h200.txtpb"),
        "GPU_HOST_GIB": "120",
        "JAX_PLATFORMS": "cpu",
    }
    cmd = [sys.executable, str(root / "experiments/throughput.py"), "--config"]
    cmd += [str(root / "configs/tiny.py"), "--steps", "-1", "--child"]
    cmd += ["--config.model.dtype=bfloat16", "--config.offload.policy=optimizer"]
    cmd += ["--config.offload.device_gib=132.81"]
    result = throughput.run(cmd, tmp_path, env=env)
    assert result.get("fits") and result["compiled_for"] == "NVIDIA H200", result
    assert result["kernels"].get("__cudnn$fmhaSoftmax") == 1, result["kernels"]


def test_dispatch_memory_keeps_the_most_in_use_and_the_smallest_largest_free_block():
    gib = 2**30
    rows = [("microbatch", 90 * gib, 40 * gib), ("update group", 60 * gib, 70 * gib)]
    rows += [("microbatch", 95 * gib, 30 * gib)]
    assert throughput.summarize_dispatch_memory(rows) == {
        "microbatch": {"dispatches": 2, "most_in_use_gib": 95.0, "least_largest_free_gib": 30.0},
        "update group": {"dispatches": 1, "most_in_use_gib": 60.0, "least_largest_free_gib": 70.0},
    }


def test_dispatch_memory_is_recorded_at_each_dispatch_and_allocation_between_microbatches():
    """TRACE_DISPATCH_MEMORY's hooks on an update between microbatches: a row at every
    microbatch's and update group's dispatch, and after every group's fetch (on the CPU the
    allocator keeps no statistics: the calls are what is checked)."""
    from angel_jax.data import make_batches
    from angel_jax.mesh import make_mesh
    from angel_jax.train import build
    from tests.test_offload import DELAYED
    from tests.test_train_parity import small_config

    config = small_config(
        microbatches=4, train__batch_size=32, offload__delayed_update=True, **DELAYED
    )
    exp = build(config, make_mesh(config.mesh))
    assert exp.steps.between_microbatches
    rows = []
    state = exp.init_state()
    with throughput.trace_dispatch_memory(exp, rows):
        for batch in make_batches(config)[:2]:  # The second step runs the first's update.
            state, _ = exp.train_step(state, exp.global_batch(batch))
    groups = len(exp.streamed_update.groups)
    assert collections.Counter(name for name, _, _ in rows) == {
        "microbatch": 8,
        "update group": groups,
        "after fetch group": groups,
    }
    calls = [name for name, _, _ in rows]
    # The first step has no update waiting; each group is fetched before the microbatch that
    # its update is dispatched after.
    fetched_ahead = ["after fetch group", "microbatch", "update group", "after fetch group"]
    assert calls[:8] == ["microbatch"] * 4 + fetched_ahead, calls


def test_the_allocator_model_takes_the_best_fit_and_merges_freed_neighbours():
    """experiments/allocator_model.py's pool, as XLA's BFC allocator places: the smallest free
    chunk that fits (lowest address among equals), split only when the rest is worth it,
    freed neighbours merged, a request larger than every hole refused with what is free."""
    import allocator_model

    mib = 2**20
    pool = allocator_model.BestFit(1024 * mib)
    for name in "abcd":
        pool.alloc(name, 200 * mib)
    pool.release("b")  # A 200 MiB hole between a and c; 224 MiB at the end.
    pool.alloc("e", 150 * mib)  # Into the hole, not the larger end.
    assert pool.at["e"] == pool.at["a"] + 200 * mib
    assert pool.used[pool.at["e"]] == 200 * mib  # A 50 MiB rest is not split off.
    pool.release("c")
    pool.release("e")  # Merged with c's hole: one 400 MiB block.
    assert pool.largest_free() == 400 * mib
    with pytest.raises(MemoryError, match="free in 2 holes"):
        pool.alloc("f", 500 * mib)


def test_the_one_gpu_runs_call_scripts_that_exist(tmp_path):
    """Every script `one_gpu.sh`'s runs call exists, so a renamed one fails here, not on the
    GPU."""
    argv = tmp_path / "argv"
    python = tmp_path / "python"  # Records each call's arguments instead of running anything.
    python.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" "--end--" >> {argv}\n')
    python.chmod(0o755)
    env = dict(os.environ, PYTHON=str(python), OUT=str(tmp_path / "out"), GPU_JOB_SKIP_SETUP="1")
    script = throughput.ROOT / "experiments/one_gpu.sh"
    for label in set(re.findall(r"^(\w+)\)$", script.read_text(), re.M)) - {"setup"}:
        argv.write_text("")
        subprocess.run(["bash", str(script), label], env=env, check=True, capture_output=True)
        calls = [c.strip("\n").split("\n") for c in argv.read_text().split("--end--\n")[:-1]]
        assert calls, label
        for args in calls:
            assert (throughput.ROOT / "experiments" / args[0]).is_file(), (label, args)


def test_an_offloaded_child_reports_its_update(monkeypatch):
    """`throughput.child` on an offloaded run (the tiny config on the CPU): its result holds
    the plan's bytes moved and the broken-down step's parts, each once (a key both gave made
    every offloaded GPU row fail on 2026-12-05)."""
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    overrides = ["--config.offload.policy=optimizer", "--config.offload.cpu_update=0"]
    overrides += ["--config.model.dtype=bfloat16", "--config.train.steps=3"]
    result = throughput.run_ours(str(throughput.ROOT / "configs/tiny.py"), overrides, 1, 1)
    assert "error" not in result, result
    assert result["split_masters"] and result["update_gb_each_way"] > 0, result
    assert result["compute_s"] > 0 and result["update_gbps_each_way"] > 0, result
