"""Issue 25's two-GPU steps compiled where fewer GPUs are lent: JAX's compile-only devices of a
described topology (two GPUs of this machine's kind on one host) stand in for the GPUs, so each
run's step is planned and compiled from shapes as it would be on two, and nothing runs.

    python experiments/two_gpu_compiled.py [--only 1,5,6] [--jobs 4] [--out FILE] [--hlo-dir DIR]

Each run (`two_gpu.sh`'s, from the same scripts' definitions) is a child of throughput.py with
COMPILE_FOR_DEVICES=2: it records the plan against the compiled program's memory per device
(a plan the compiled step outgrows is planned again or refused, as on the GPUs), the kernels
(custom calls), the collectives' count and bytes per device per step, and how XLA scheduled
them (`throughput.collective_schedule`: left synchronous, moved by the collective pipeliner,
inside the layer loop). No time is measured. The compile-only devices are not autotuned on, so
a kernel XLA's autotuner picks on real devices may differ; collectives and memory are the
program's. The host budget is this machine's, shared by the two devices.
"""

import argparse
import concurrent.futures as futures
import os
import pathlib
import re
import sys

import long_context
import pipeline
import scaling
from fp8_throughput import fp8_variants
from moe_throughput import moe_runs
from throughput import ROOT, run_ours, write_results

LLAMA_1B, LLAMA3_8B = (str(ROOT / f"configs/{n}.py") for n in ("llama_1b", "llama3_8b"))


def runs() -> list[tuple[str, str, str, list[str], str]]:
    """(two_gpu.sh's run, name, config, overrides, XLA flags) of each two-GPU step, under
    each run that takes it."""
    out = [
        ("1", f"weak data=2, collectives {setting}", LLAMA_1B, scaling.weak_overrides(2, 3), flags)
        for setting, flags in scaling.COLLECTIVES.items()
    ]
    for group, name, overrides in pipeline.runs():
        main = name in ("data=2", "pipeline=2 1f1b m=8")
        number = "2a" if main or group == "balance" else "2b"
        out.append((number, name, LLAMA_1B, overrides, ""))
    for number, kind, axes, length in (
        ("3a", "context", (2, 1), 524288),
        ("3a", "context", (2, 1), 131072),
        ("3b", "sequence", (1, 2), 524288),
    ):
        overrides = long_context.run_overrides(length, *axes)
        out.append((number, f"{kind}=2 at {length:,} tokens", LLAMA_1B, overrides, ""))
    for number, routers in (("4a", "dropless,topk"), ("4b", "expert_choice")):
        moe = moe_runs(2, 8, routers, "1,4", "auto", [])
        out += [
            (number, name, str(ROOT / config), overrides, "") for name, config, overrides in moe
        ]
    fp8 = ((LLAMA_1B, "--config.train.batch_size=16"), (LLAMA3_8B, "--config.model.remat=full"))
    for config, extra in fp8:
        base, variants = fp8_variants(2, [extra])
        model = pathlib.Path(config).stem
        out += [
            ("5", f"{model} zero3 {name}", config, [*base, *overrides], "")
            for name, overrides in variants
            if name in ("bf16", "fp8 collectives")
        ]
    out += [
        ("6", name, config, overrides, "")
        for name, config, overrides in scaling.named_runs(2, LLAMA_1B)
        if name.startswith("llama3_8b") and "pipeline" not in name
    ]
    return out


def selected(only: str) -> list[tuple]:
    """The runs of two_gpu.sh's comma-separated `only` (all when empty; 2 is 2a and 2b), each
    step once (4b's dense twin is 4a's): the first label kept."""
    labels = set(filter(None, only.split(",")))
    seen, out = set(), []
    for run in runs():
        key = (run[2], tuple(run[3]), run[4])
        if (not labels or labels & {run[0], run[0].rstrip("ab")}) and key not in seen:
            seen.add(key)
            out.append(run)
    return out


def compile_run(run: tuple, hlo_dir: str) -> dict:
    number, name, config, overrides, flags = run
    env = {
        "COMPILE_FOR_DEVICES": "2",
        "THROUGHPUT_HLO_DIR": str(pathlib.Path(hlo_dir) / re.sub(r"[^\w.=-]+", "_", name)),
        # Children compile side by side on one GPU: none takes its memory up front. The
        # planner's budget is the allocator's limit, the memory fraction the two-GPU runs
        # take (two_gpu.sh), allocated or not.
        "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
        "XLA_PYTHON_CLIENT_MEM_FRACTION": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95"),
    }
    result = run_ours(config, overrides, -1, 0, flags, env)
    return {**result, "run": number, "system": name, "overrides": overrides, "xla_flags": flags}


def summary(r: dict) -> str:
    if "error" in r:
        return f"failed: {' | '.join(r['error'])[:300]}"
    memory = (
        f"plan {r['plan']}, remat {r['remat']}: planned {r['planned_device_gib']:.1f} GiB, "
        f"compiled temporaries {r.get('compiled_temp_gib', 0):.1f} + arguments "
        f"{r.get('compiled_argument_gib', 0):.1f} GiB"
    )
    wire = []
    for kind, (n, size) in r.get("collectives", {}).items():
        placed = dict(r["collective_schedule"].get(kind, {}))
        ops = placed.pop("ops", 0)
        counts = "".join(f", {v} {k}" for k, v in placed.items())
        wire.append(f"{kind} {n} ops run, {size / 1e9:,.2f} GB{counts} (of {ops} ops)")
    wire = "; ".join(wire)
    return f"{memory}\n    {wire or 'no collectives'}\n    kernels {r.get('kernels', {})}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--only", default="", help="comma-separated runs of two_gpu.sh (1, 2a, ..., 6)")
    p.add_argument("--jobs", type=int, default=4, help="children compiling at once")
    p.add_argument("--out", default=str(ROOT / "runs/experiments/two_gpu_compiled.json"))
    p.add_argument("--hlo-dir", default="/tmp/two_gpu_compiled_hlo")
    a = p.parse_args()
    todo = selected(a.only)
    # This process records the machine (JAX on the GPU) beside the children: it takes none of
    # the GPU's memory up front either.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    results = []
    with futures.ThreadPoolExecutor(a.jobs) as pool:
        for done in futures.as_completed([pool.submit(compile_run, r, a.hlo_dir) for r in todo]):
            result = done.result()
            results.append(result)
            print(f"[run {result['run']}] {result['system']}: {summary(result)}", flush=True)
            write_results(a.out, results)  # So far: a call cut short keeps what compiled.
    return 0


if __name__ == "__main__":
    sys.exit(main())
