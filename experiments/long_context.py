"""Longest trainable context: the `llama_1b` shape at growing sequence lengths, one process each.

    python experiments/long_context.py [--context 1 | --sequence 1] [--start 32768] [--max 1048576]

Each length (doubling from --start) trains 2 steps of one sequence per context group (batch =
1 on one GPU) with full remat and chunked logits; the table gives tokens/s, MFU (attention
FLOPs included) and peak memory, and the longest length that trained. --context N splits the
sequence over N devices with ring attention, --sequence N with Ulysses all-to-all (each device
then runs cuDNN flash attention over the whole sequence for 1/N of the heads); it stops at the
first length that fails.
"""

import argparse
import json
import sys

from throughput import ROOT, run_ours, write_results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", default=str(ROOT / "configs/llama_1b.py"))
    p.add_argument("--context", type=int, default=1, help="ring attention over N devices")
    p.add_argument("--sequence", type=int, default=1, help="Ulysses all-to-all over N devices")
    p.add_argument("--start", type=int, default=32768)
    p.add_argument("--max", type=int, default=1 << 20)
    p.add_argument("--ring-blocks", default="auto", choices=("auto", "tokamax", "xla"))
    p.add_argument("--out", default=str(ROOT / "experiments/results/long_context.json"))
    args = p.parse_args()
    results, length, devices = [], args.start, args.context * args.sequence
    while length <= args.max:
        overrides = [
            f"--config.train.seq_len={length}",
            "--config.train.batch_size=1",
            f"--config.mesh.context={args.context}",
            f"--config.mesh.sequence={args.sequence}",
            "--config.mesh.data=1",
            "--config.model.remat=full",
            # About 8k positions per slice of logits (32000 x 8192 x 4 bytes = 1 GiB).
            f"--config.model.logits_chunks={max(1, length // devices // 8192)}",
            f"--config.model.ring_blocks={args.ring_blocks}",
            "--config.checkpoint.every_steps=0",
        ]
        result = run_ours(args.config, overrides, steps=1, warmup=1)
        results.append(
            {**result, "seq_len": length, "context": args.context, "sequence": args.sequence}
        )
        print(json.dumps(results[-1]), flush=True)
        if "tokens_per_s" not in result:
            break
        length *= 2
    print(f"\n{'seq_len':>9} {'tokens/s':>10} {'MFU':>6} {'peak GiB':>9}")
    for r in results:
        if "tokens_per_s" not in r:
            print(f"{r['seq_len']:>9} failed: {r.get('error')}")
        else:
            tps, mfu, peak = r["tokens_per_s"], r["mfu"], r["peak_gib"]
            print(f"{r['seq_len']:>9} {tps:>10,.0f} {mfu:>6.3f} {peak:>9.1f}")
    trained = [r["seq_len"] for r in results if "tokens_per_s" in r]
    print(f"longest trained: {max(trained) if trained else 'none'} tokens on {devices} device(s)")
    write_results(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
