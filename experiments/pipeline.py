"""Pipeline parallelism on two GPUs: `llama_1b` with pipeline=2 beside data parallel, the
measured bubble beside theory, and the balanced layer split beside others.

    python experiments/pipeline.py [--steps 5] [--out runs/experiments/pipeline.json]

Every run is a child process (experiments/throughput.py's worker) with a clean GPU; this
process imports JAX only after the last child, for the planner's predictions.

- Throughput: data=2 vs pipeline=2 (1F1B, GPipe, circular with 2 virtual stages) at the same
  global batch, tokens/s of the two GPUs together.
- Bubble: 1F1B with m = 2, 4, 8, 16 microbatches of a fixed size. A step takes about
  (m + p - 1) ticks of one microbatch's time tau (+ a fixed part); a least-squares line through
  the step times gives tau, and the measured bubble is 1 - m tau / step time, beside the
  theory's (p - 1) / (m + p - 1).
- Balance: step time of the planner's split (auto) beside the even split and two others, with
  the planner's predicted critical path and slowest stage for each. One program runs on both
  stages, so a stage's own time is not measured apart; the step time is what it costs.
"""

import argparse
import json
import sys

from throughput import ROOT, print_table, run_ours, write_results

CONFIG = str(ROOT / "configs/llama_1b.py")
MICROBATCH = 2  # Sequences per microbatch.


def pipeline_overrides(schedule="1f1b", microbatches=8, balance="auto", virtual=1) -> list[str]:
    return [
        "--config.mesh.data=1",
        "--config.mesh.pipeline=2",
        f"--config.pipeline.schedule={schedule}",
        f"--config.pipeline.microbatches={microbatches}",
        f"--config.pipeline.virtual_stages={virtual}",
        f"--config.pipeline.balance={balance}",
        f"--config.train.batch_size={MICROBATCH * microbatches}",
    ]


def runs() -> list[tuple[str, str, list[str]]]:
    """(group, name, overrides) of every run."""
    batch = f"--config.train.batch_size={MICROBATCH * 8}"
    out = [
        ("throughput", "data=2", ["--config.mesh.data=2", batch]),
        ("throughput", "pipeline=2 1f1b m=8", pipeline_overrides()),
        ("throughput", "pipeline=2 gpipe m=8", pipeline_overrides("gpipe")),
        ("throughput", "pipeline=2 circular v=2 m=8", pipeline_overrides("circular", virtual=2)),
    ]
    for m in (2, 4, 16):  # m = 8 is the throughput run.
        out.append(("bubble", f"pipeline=2 1f1b m={m}", pipeline_overrides(microbatches=m)))
    for balance in ("even", "13,9", "10,12"):  # auto is the throughput run's (12,10).
        out.append(("balance", f"pipeline=2 1f1b {balance}", pipeline_overrides(balance=balance)))
    return out


def measured_bubbles(results: list[dict]) -> list[dict]:
    """The bubble of each 1F1B run of the m sweep, from a line through its step times."""
    import numpy as np

    sweep = [r for r in results if r["system"].startswith("pipeline=2 1f1b m=") and "step_s" in r]
    if len(sweep) < 2:
        return []
    m = np.array([int(r["system"].rsplit("=", 1)[1]) for r in sweep], np.float64)
    step = np.array([r["step_s"] for r in sweep])
    tau, fixed = np.polyfit(m, step, 1)
    return [
        dict(
            microbatches=int(mi),
            step_s=float(si),
            microbatch_s=float(tau),
            fixed_s=float(fixed),
            measured=float(1 - mi * tau / si),
            theory=float(1 / (mi + 1)),  # (p - 1) / (m + p - 1) with p = 2.
        )
        for mi, si in sorted(zip(m, step, strict=True))
    ]


def predictions(results: list[dict]) -> None:
    """Adds the planner's split, predicted critical path and slowest stage (in FLOPs) to
    every pipeline run (after every child has finished: this imports JAX)."""
    sys.path.insert(0, str(ROOT))
    from angel_jax import machine
    from angel_jax.config import load_config
    from angel_jax.models import make_model
    from angel_jax.planning.inputs import plan_input
    from angel_jax.planning.stage_plan import make_pipeline_plan

    shape = dict(data=1, pipeline=2, expert=1, context=1, sequence=1, tensor=1)
    for r in results:
        if "--config.mesh.pipeline=2" not in r["overrides"]:
            continue
        config = load_config(CONFIG, r["overrides"])
        cfg = make_model(config.model, "gpu")[0]
        machine.describe("gpu", machine.host_available())  # Planned as on the GPU that ran.
        try:
            plan = make_pipeline_plan(plan_input(config, shape, cfg, budget={}), cfg)
        finally:
            machine.describe(None)
        r.update(
            layers_per_chunk=list(plan.layout.layers_per_chunk),
            predicted_step_flops=plan.step_flops(),
            predicted_slowest_stage_flops=float(plan.stage_busy_flops().max()),
            theory_bubble=plan.schedule.bubble(),
            plan=plan.table(),
        )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument(
        "--only", default="", help="comma-separated groups (throughput,bubble,balance) or runs"
    )
    p.add_argument("--out", default=str(ROOT / "runs/experiments/pipeline.json"))
    a = p.parse_args()
    only = set(filter(None, a.only.split(",")))
    results = []
    for group, name, overrides in runs():
        if only and group not in only and name not in only:
            continue
        timing = run_ours(CONFIG, overrides, a.steps, warmup=2)
        results.append({**timing, "system": name, "group": group, "overrides": overrides})
        print(json.dumps(results[-1]), flush=True)
    predictions(results)
    bubbles = measured_bubbles(results)
    print_table(results)
    for b in bubbles:
        m, measured, theory = b["microbatches"], b["measured"], b["theory"]
        print(f"m={m:>3}  bubble measured {measured:.3f}  theory {theory:.3f}")
    write_results(a.out, [*results, {"system": "bubble fit", "bubbles": bubbles}])
    return 0


if __name__ == "__main__":
    sys.exit(main())
