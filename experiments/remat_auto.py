"""config.model.remat=auto against remat set by hand, on one GPU, in one job: which policy the
planner picks as the batch grows, whether its step fits, and its speed beside the others.

    python experiments/remat_auto.py [--batches 48,56] [--out runs/experiments/remat_auto.json]

Each run is `llama_1b` (no offload) in its own process; a remat whose plan or compiled step
does not fit is recorded as refused (before anything is allocated). The anomaly guard is off
(`monitor.on_anomaly=log`), so the step `build` compiles and checks is the one timed.
"""

import argparse
import pathlib
import sys

from throughput import ROOT, run_ours, write_results

REMATS = ("auto", "dots_attention", "dots_no_batch", "full")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", default=str(ROOT / "configs/llama_1b.py"))
    p.add_argument("--batches", default="48,56", help="comma-separated rows a step")
    p.add_argument("--remats", default=",".join(REMATS), help="comma-separated remat settings")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default=str(ROOT / "runs/experiments/remat_auto.json"))
    a = p.parse_args()
    results = []
    for batch in map(int, a.batches.split(",")):
        for remat in a.remats.split(","):
            overrides = [
                f"--config.train.batch_size={batch}",
                f"--config.model.remat={remat}",
                "--config.monitor.on_anomaly=log",
            ]
            r = run_ours(str(pathlib.Path(a.config).resolve()), overrides, a.steps, a.warmup)
            results.append({**r, "system": f"batch {batch}, remat {remat}", "asked": remat})
            print(results[-1].get("remat"), results[-1].get("tokens_per_s"), flush=True)
    head = ("run", "remat", "tokens/s", "MFU", "peak GiB", "planned", "temps GiB", "build s")
    print("\n{:<32} {:>15} {:>9} {:>6} {:>8} {:>8} {:>9} {:>7}".format(*head))
    for r in results:
        if "tokens_per_s" not in r:
            error = " ".join(str(r.get("error", "")).split())
            print(f"{r['system']:<32} refused or failed: {error[-160:]}")
            continue
        print(
            f"{r['system']:<32} {r['remat']:>15} {r['tokens_per_s']:>9,.0f} {r['mfu']:>6.3f} "
            f"{r['peak_gib']:>8.1f} {r['planned_device_gib']:>8.1f} "
            f"{r.get('compiled_temp_gib') or 0:>9.1f} {r['build_s']:>7.1f}"
        )
    write_results(a.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
