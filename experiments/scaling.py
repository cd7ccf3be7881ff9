"""Scaling over the GPUs of one host: weak scaling of `llama_1b` (the same batch per GPU) from
one GPU up, then the named runs at the largest count, each in its own process.

    python experiments/scaling.py [--gpus 1,2,4,8] [--only weak,...] [--out FILE]
    python experiments/scaling.py --cpu --gpus 1,2,4 --config configs/tiny.py  # emulated
    python experiments/scaling.py --gpus 1,2 --only weak --zero-stage 3 \
        --collectives "default,pipelined,prefetch + latency hiding"  # weak runs per setting

Weak scaling efficiency at n GPUs is tokens/s(n) / (n x tokens/s(1)). At the largest count
(`n`): `llama3_8b` with ZeRO-3 over all, tensor=2 x data (with and without Megatron's
sequence parallel), pipeline=2 x data; the MoE with
expert=n; FP8 against bf16 ZeRO-3 collectives on `llama_1b`. Writes the JSON and a plot of the
efficiency (`.png` beside it). `--cpu` runs on emulated CPU devices, to try the script.
"""

import argparse
import json
import pathlib
import sys

from throughput import (
    COMBINE_256MIB,
    LATENCY_HIDING,
    PIPELINED,
    ROOT,
    print_table,
    run_ours,
    write_results,
)

CONFIGS = ROOT / "configs"
# XLA settings of the collectives for the weak runs on more than one GPU (`--collectives`).
COLLECTIVES = {
    "default": "",
    "combined 256 MiB": COMBINE_256MIB,
    "pipelined": PIPELINED,
    "prefetch + latency hiding": LATENCY_HIDING,
}


def named_runs(n: int, config: str) -> list[tuple[str, str, list[str]]]:
    """(name, config, overrides) of the runs at n GPUs besides weak scaling."""
    big = str(CONFIGS / "llama3_8b.py")  # Its remat: the planner's pick (auto).
    return [
        (f"llama3_8b zero3 data={n}", big, [f"--config.mesh.data={n}"]),
        (
            f"llama3_8b tensor=2 data={n // 2}",
            big,
            ["--config.mesh.tensor=2", f"--config.mesh.data={n // 2}"],
        ),
        (  # Megatron's sequence parallel: norm regions split over `tensor` too.
            f"llama3_8b tensor=2 sequence parallel data={n // 2}",
            big,
            [
                "--config.mesh.tensor=2",
                f"--config.mesh.data={n // 2}",
                "--config.model.sequence_parallel=true",
            ],
        ),
        (
            f"llama3_8b pipeline=2 data={n // 2}",
            big,
            [
                "--config.mesh.pipeline=2",
                f"--config.mesh.data={n // 2}",
                "--config.train.microbatches=1",
                "--config.pipeline.microbatches=8",
                "--config.train.batch_size=16",
                "--config.zero_stage=1",
                # cuDNN's partitioner fails with data split too (stage_plan.py); XLA's
                # attention keeps (T, T) scores: at n = 2 its step needed 157.6 GiB a GPU,
                # with cuDNN's 123.4 (compiled for two H200s, two_gpu_compiled.py).
                *(["--config.model.attention=xla"] if n > 2 else []),
            ],
        ),
        (
            f"moe expert={n}",
            str(CONFIGS / "moe_1b.py"),
            [
                f"--config.mesh.expert={n}",
                "--config.mesh.data=1",
                f"--config.train.batch_size={8 * n}",
            ],
        ),
        (
            f"bf16 zero3 data={n}",
            config,
            [
                f"--config.mesh.data={n}",
                "--config.zero_stage=3",
                f"--config.train.batch_size={8 * n}",
            ],
        ),
        (
            f"fp8 collectives data={n}",
            config,
            [
                f"--config.mesh.data={n}",
                "--config.zero_stage=3",
                "--config.fp8.collectives=true",
                f"--config.train.batch_size={8 * n}",
            ],
        ),
    ]


def weak_overrides(n: int, zero_stage: int | None) -> list[str]:
    """A weak-scaling run's overrides at n GPUs: 8 sequences per GPU over `data`."""
    zero = [] if zero_stage is None else [f"--config.zero_stage={zero_stage}"]
    return [f"--config.mesh.data={n}", f"--config.train.batch_size={8 * n}", *zero]


def devices_env(n: int, cpu: bool) -> tuple[str, dict]:
    """(XLA flags, environment) that make a child see n devices."""
    if cpu:
        return f"--xla_force_host_platform_device_count={n}", {"JAX_PLATFORMS": "cpu"}
    return "", {"CUDA_VISIBLE_DEVICES": ",".join(map(str, range(n)))}


def plot(results: list[dict], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    settings = dict.fromkeys(
        r.get("collective_setting") for r in results if r.get("group") == "weak"
    )
    for setting in settings:
        weak = [
            r
            for r in results
            if r.get("group") == "weak"
            and "efficiency" in r
            and r.get("collective_setting") in (setting, "default")
        ]
        label = "llama_1b" + ("" if setting == "default" else f", {setting}")
        ax.plot([r["gpus"] for r in weak], [r["efficiency"] for r in weak], "o-", label=label)
    ax.axhline(0.97, color="tab:gray", ls="--", label="goal 0.97")
    ax.set_xlabel("GPUs (same batch per GPU)")
    ax.set_ylabel("weak scaling efficiency")
    ax.set_ylim(0.5, 1.05)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", default=str(CONFIGS / "llama_1b.py"))
    p.add_argument("--gpus", default="1,2,4,8")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--only", default="", help="comma-separated: weak, or names of runs")
    p.add_argument("--cpu", action="store_true", help="emulated CPU devices")
    p.add_argument("--zero-stage", type=int, help="config.zero_stage of the weak runs")
    p.add_argument(
        "--collectives",
        default="default",
        help=f"comma-separated settings for the weak runs past one GPU: {', '.join(COLLECTIVES)}",
    )
    p.add_argument("--out", default=str(ROOT / "runs/experiments/scaling.json"))
    a = p.parse_args()
    a.config = str(pathlib.Path(a.config).resolve())  # The children run in the repository root.
    counts = [int(x) for x in a.gpus.split(",")]
    only = set(filter(None, a.only.split(",")))
    results = []

    def record(result: dict) -> None:
        results.append(result)
        print(json.dumps(result), flush=True)
        write_results(a.out, results)  # So far: a run cut short keeps what it measured.

    settings = a.collectives.split(",")
    for setting in settings:
        if setting not in COLLECTIVES:
            p.error(f"--collectives: {setting!r} is none of {', '.join(COLLECTIVES)}")
    if not only or "weak" in only:
        for n in counts:
            for setting in settings if n > 1 else ["default"]:  # One GPU: no collectives.
                flags, env = devices_env(n, a.cpu)
                overrides = weak_overrides(n, a.zero_stage)
                flags = f"{flags} {COLLECTIVES[setting]}".strip()
                r = run_ours(a.config, overrides, a.steps, 2, flags, env)
                one = next((x for x in results if x.get("gpus") == 1 and "tokens_per_s" in x), None)
                if one and "tokens_per_s" in r:
                    r["efficiency"] = r["tokens_per_s"] / (n * one["tokens_per_s"])
                name = f"weak data={n}" + (f", collectives {setting}" if n > 1 else "")
                record(
                    {**r, "system": name, "group": "weak", "gpus": n, "collective_setting": setting}
                    | {"overrides": overrides, "xla_flags": flags}
                )
    n = max(counts)
    flags, env = devices_env(n, a.cpu)
    for name, config, overrides in named_runs(n, a.config):
        if only and name not in only:
            continue
        r = run_ours(config, overrides, a.steps, 2, flags, env)
        record({**r, "system": name, "group": "named", "gpus": n, "overrides": overrides})
    print_table(results)
    for r in results:
        if "efficiency" in r:
            print(f"{r['system']}: weak scaling efficiency {r['efficiency']:.3f}")
    plot(results, pathlib.Path(a.out).with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
