"""Multi-controller training on one machine's two GPUs: one process per GPU against one process
driving both, with a crash and a resume in between. Not yet run (written without a GPU).

    python experiments/multiprocess.py [--out runs/experiments/multiprocess_2gpu.json]

1. `one process`: one process, both GPUs, data=2; trains --steps steps uninterrupted.
2. `two processes`: a process per GPU (CUDA_VISIBLE_DEVICES), joined through
   jax.distributed (--coordinator localhost:PORT); both are SIGKILLed before step --crash-at
   (ANGEL_FAULTS), then both are started again and resume from their last checkpoint.

It reports each run's losses (they must agree: same mesh shape, same batches), steady step time
and tokens/s (the median over steps that neither compile nor checkpoint), the time from the
relaunch to the first resumed step (restore and compile, the latter from the persistent cache),
and the checkpoint the restart resumed from. Checkpoints go to --workdir (local disk; each one
of llama_1b's fp32 params and Adam state is about 16 bytes a parameter, so `--layers` keeps the
model smaller by default).
"""

import argparse
import json
import os
import pathlib
import shutil
import socket
import statistics
import subprocess
import sys
import time

from throughput import ROOT, write_results


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def launch(args, workdir, gpus: str, env_extra: dict, cluster: list[str]) -> subprocess.Popen:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=gpus, **env_extra)
    command = [sys.executable, "-m", "angel_jax.launch", "--workdir", str(workdir), *cluster]
    return subprocess.Popen([*command, *args], cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)


def wait_all(procs) -> list[tuple[int, str]]:
    out = []
    for proc in procs:
        _, err = proc.communicate()
        out.append((proc.returncode, err))
    return out


def metrics(workdir) -> dict[int, dict]:
    """Per step, the last line logged (a resumed run logs its steps again)."""
    lines = (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines)}


def steady(records: dict[int, dict], every: int) -> dict:
    times = [
        r["step_time_s"]
        for step, r in records.items()
        if not r.get("includes_compile") and step % every not in (0, 1)
    ]
    step_s = statistics.median(times)
    first = next(iter(records.values()))
    return dict(step_s=step_s, tokens_per_s=first["tokens_per_s"] * first["step_time_s"] / step_s)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", default=str(ROOT / "configs" / "llama_1b.py"))
    p.add_argument("--layers", type=int, default=8, help="model layers (llama_1b has 22)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--every", type=int, default=10, help="checkpoint interval")
    p.add_argument("--crash-at", type=int, default=27, help="both processes die before this step")
    p.add_argument("--workdir", default="/tmp/angel_multiprocess")
    p.add_argument("--out", default=str(ROOT / "runs/experiments/multiprocess_2gpu.json"))
    args = p.parse_args()

    work = pathlib.Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    cache = {"JAX_COMPILATION_CACHE_DIR": str(work / "jax_cache")}
    config = [
        "--config",
        args.config,
        f"--config.model.num_layers={args.layers}",
        f"--config.train.steps={args.steps}",
        "--config.train.log_every_steps=1",
        f"--config.checkpoint.every_steps={args.every}",
        "--config.checkpoint.keep=1",
        "--config.mesh.data=2",
        # The planner asks jax.devices()[0] for its memory, which only process 0 can address;
        # a given budget skips the query.
        "--config.offload.device_gib=130",
    ]
    results = dict(config=config, crash_at=args.crash_at)

    start = time.time()
    ((code, err),) = wait_all([launch(config, work / "one", "0,1", cache, [])])
    if code:
        sys.exit(f"one-process run failed ({code}):\n{err[-3000:]}")
    one = metrics(work / "one")
    results["one process"] = dict(wall_s=time.time() - start, **steady(one, args.every))
    print(json.dumps(results["one process"]), flush=True)

    def two(faults: str, watch_step: int | None = None) -> tuple[list, float | None]:
        """Runs both processes; with `watch_step`, also when that step's metrics appeared."""
        port = free_port()
        log = work / "two" / "metrics.jsonl"
        seen = log.stat().st_size if log.exists() else 0
        procs = [
            launch(
                config,
                work / "two",
                str(i),
                {**cache, "ANGEL_FAULTS": faults},
                [f"--coordinator=localhost:{port}", "--num-processes=2", f"--process-id={i}"],
            )
            for i in range(2)
        ]
        started, at = time.time(), None
        while watch_step is not None and at is None and procs[0].poll() is None:
            if log.exists() and log.stat().st_size > seen:
                new = log.read_text()[seen:].splitlines()
                if any(json.loads(x)["step"] == watch_step for x in new if x.endswith("}")):
                    at = time.time() - started
            time.sleep(0.05)
        return wait_all(procs), at

    faults = f"crash@{args.crash_at}"
    start = time.time()
    first, _ = two(faults)
    killed_s = time.time() - start
    if [c for c, _ in first] != [-9, -9]:
        sys.exit(f"expected both processes killed, got {[c for c, _ in first]}:\n{first[0][1]}")
    ckpts = [int(d.name) for d in (work / "two" / "checkpoints").iterdir() if d.name.isdigit()]
    resumed_from = max(ckpts)
    relaunch = time.time()
    second, first_step_s = two(faults, watch_step=resumed_from + 1)
    if [c for c, _ in second] != [0, 0]:
        sys.exit(f"resumed run failed {[c for c, _ in second]}:\n{second[0][1][-3000:]}")
    records = metrics(work / "two")
    results["two processes"] = dict(
        first_run_wall_s=killed_s,
        resumed_wall_s=time.time() - relaunch,
        resumed_from=resumed_from,
        # From the relaunch to the first resumed step's metrics: start, jax.distributed,
        # restore, compile (from the persistent cache) and the step.
        relaunch_to_first_step_s=first_step_s,
        **steady(records, args.every),
    )
    diffs = [abs(records[s]["loss"] - one[s]["loss"]) / abs(one[s]["loss"]) for s in one]
    results["max_rel_loss_diff"] = max(diffs)
    results["losses_one"] = [one[s]["loss"] for s in sorted(one)]
    results["losses_two"] = [records[s]["loss"] for s in sorted(records)]
    print(json.dumps({k: v for k, v in results.items() if not k.startswith("losses")}, indent=1))
    verdict = "equal" if max(diffs) == 0 else f"max relative difference {max(diffs):.1e}"
    print(f"losses, one process vs two: {verdict}")
    write_results(args.out, [results])
    return 0 if max(diffs) < 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
