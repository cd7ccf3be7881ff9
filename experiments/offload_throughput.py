"""ZeRO-Cache offload on one GPU: step time, memory and losses per policy, in one job.

    python experiments/offload_throughput.py [--out experiments/results/offload_throughput.json]

Every run checks that the offloaded policy gives the same losses as `none` on the same data
(XLA has had wrong-gradient bugs in offloaded programs on GPU), and reports the peak device
memory each policy needs.
"""

import argparse
import json
import sys

from throughput import ROOT, run_ours, write_results

VARIANTS = [
    ("llama_1b none", "llama_1b", ["--config.offload.policy=none"]),
    ("llama_1b optimizer", "llama_1b", ["--config.offload.policy=optimizer"]),
    (
        "llama_1b optimizer, 8 chunks in flight",
        "llama_1b",
        ["--config.offload.policy=optimizer", "--config.offload.chunks_in_flight=8"],
    ),
    ("llama_1b params", "llama_1b", ["--config.offload.policy=params"]),
    (
        "llama_1b params, 2 microbatches",
        "llama_1b",
        ["--config.offload.policy=params", "--config.train.microbatches=2"],
    ),
    (
        "llama_1b optimizer, 2 microbatches",
        "llama_1b",
        ["--config.offload.policy=optimizer", "--config.train.microbatches=2"],
    ),
    # fp32 masters + Adam state are 90 GiB: on the device alone they leave no room to train.
    (
        "llama3_8b optimizer, 8 x 8192 in 8 microbatches",
        "llama3_8b",
        [
            "--config.offload.policy=optimizer",
            "--config.zero_stage=1",
            "--config.train.batch_size=8",
            "--config.train.microbatches=8",
        ],
    ),
]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default=str(ROOT / "experiments/results/offload_throughput.json"))
    p.add_argument("--only", default="", help="run the variants whose name contains this")
    args = p.parse_args()
    results = []
    for name, config, overrides in VARIANTS:
        if args.only not in name:
            continue
        config_path = str(ROOT / "configs" / f"{config}.py")
        timing = run_ours(config_path, overrides, args.steps, args.warmup)
        results.append({**timing, "system": name, "overrides": overrides})
        print(json.dumps(results[-1]), flush=True)

    ref = {r["system"].split()[0]: r for r in results if r["system"].endswith(" none")}
    print(f"\n{'variant':<40} {'step s':>8} {'tokens/s':>10} {'MFU':>6} {'peak GiB':>9}  losses")
    for r in results:
        if "tokens_per_s" not in r:
            print(f"{r['system']:<40} failed: {r.get('error')}")
            continue
        base = ref.get(r["system"].split()[0])
        same = ""
        if base is not None and base is not r:
            pairs = zip(r["warmup_losses"], base["warmup_losses"], strict=True)
            diff = max(abs(a - b) / abs(b) for a, b in pairs)
            same = f" (vs none: max rel. diff {diff:.1e}{'' if diff < 1e-3 else ', TOO LARGE'})"
        losses = ", ".join(f"{x:.4f}" for x in r["warmup_losses"])
        print(
            f"{r['system']:<40} {r['step_s']:>8.3f} {r['tokens_per_s']:>10,.0f} "
            f"{r['mfu']:>6.3f} {r['peak_gib']:>9.1f}  {losses}{same}"
        )
    write_results(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
