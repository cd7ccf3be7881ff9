"""Accuracy of the cheaper-communication and FP8 switches: `configs/tiny.py` on the default corpus
for --steps steps per variant, against the bf16 run, on 8 devices (emulated on a CPU).

    python experiments/fp8_accuracy.py [--steps 400] [--out runs/experiments/fp8_accuracy.json]

Variants: bf16 (ZeRO-3), FP8 matmuls, FP8 ZeRO-3 collectives, both, and PowerSGD (ranks 4 and
16 from step 100 of 400, plain data parallel, against its own uncompressed run). The final
loss is the mean of the last 10% of the logged steps; the table gives it and its relative gap to
the baseline (goals: within 1% for FP8, 2% for PowerSGD). A plot of the curves goes beside the JSON.
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

from throughput import ROOT, write_results

COMMON = ["--config.checkpoint.every_steps=0", "--config.train.log_every_steps=5"]
ZERO3 = ["--config.zero_stage=3"]
POWERSGD_START = "--config.train.powersgd_start_step=100"  # A quarter of the run averages exactly.
VARIANTS = [
    ("bf16", ZERO3, None),
    ("fp8 matmul", [*ZERO3, "--config.fp8.matmul=true"], "bf16"),
    ("fp8 collectives", [*ZERO3, "--config.fp8.collectives=true"], "bf16"),
    ("fp8 both", [*ZERO3, "--config.fp8.matmul=true", "--config.fp8.collectives=true"], "bf16"),
    ("data parallel", ["--config.zero_stage=0"], None),
    *(
        (
            f"powersgd rank {rank}",
            ["--config.zero_stage=0", f"--config.train.powersgd_rank={rank}", POWERSGD_START],
            "data parallel",
        )
        for rank in (4, 16)
    ),
]


DEVICES = "--xla_force_host_platform_device_count=8"


def train(overrides: list[str], steps: int) -> list[dict]:
    """The logged metrics of one run of the launcher, in a process of its own."""
    env = dict(os.environ, XLA_FLAGS=DEVICES)
    with tempfile.TemporaryDirectory() as workdir:
        cmd = [sys.executable, "-m", "angel_jax.launch", "--config", "configs/tiny.py"]
        cmd += ["--workdir", workdir, f"--config.train.steps={steps}", *COMMON, *overrides]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        if proc.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
        lines = pathlib.Path(workdir, "metrics.jsonl").read_text().splitlines()
        return [json.loads(line) for line in lines]


def final_loss(metrics: list[dict]) -> float:
    tail = metrics[-max(1, len(metrics) // 10) :]
    return sum(m["loss"] for m in tail) / len(tail)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--out", default=str(ROOT / "runs/experiments/fp8_accuracy.json"))
    p.add_argument("--cache", default="/tmp/fp8_accuracy", help="finished runs' metrics")
    a = p.parse_args()
    os.environ["XLA_FLAGS"] = DEVICES  # The record's machine: the 8 devices the runs used.
    results = {}
    cache = pathlib.Path(a.cache)
    cache.mkdir(parents=True, exist_ok=True)
    for name, overrides, _ in VARIANTS:
        # Each finished run is kept, so a rerun after a failure redoes only what is missing.
        done = cache / f"{name.replace(' ', '_')}-{a.steps}.json"
        if not done.exists():
            done.write_text(json.dumps(train(overrides, a.steps)))
        metrics = json.loads(done.read_text())
        results[name] = dict(overrides=overrides, curve=metrics, final_loss=final_loss(metrics))
        print(f"{name:<18} final loss {results[name]['final_loss']:.4f}", flush=True)
    rows = []
    print(f"\n{'variant':<18} {'final loss':>10} {'vs':>14} {'gap':>7}")
    for name, _, base in VARIANTS:
        loss = results[name]["final_loss"]
        gap = (loss - results[base]["final_loss"]) / results[base]["final_loss"] if base else 0.0
        rows.append(dict(variant=name, baseline=base, relative_gap=gap, **results[name]))
        print(f"{name:<18} {loss:>10.4f} {base or '-':>14} {gap:>+7.2%}")
    write_results(a.out, rows)
    plot(rows, a.out.removesuffix(".json") + ".png")
    return 0


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in rows:
        steps = [m["step"] for m in r["curve"]]
        ax.plot(steps, [m["loss"] for m in r["curve"]], label=r["variant"], linewidth=1)
    ax.set(xlabel="step", ylabel="training loss", title="configs/tiny.py, 8 devices", yscale="log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
