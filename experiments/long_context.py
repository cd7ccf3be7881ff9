"""Longest trainable context: the `llama_1b` shape at growing sequence lengths, one process each.

    python experiments/long_context.py [--context 1 | --sequence 1] [--start 32768] [--max 1048576]
        [--activations auto|device|host] [--mlp-chunks N] [--remats auto] [--warmup 1]
        [--steps 1] [--device-gib 0] [--compile-only]

Each length (doubling from --start) trains `--warmup` then `--steps` timed steps of one
sequence per context group (batch = 1 on one GPU) with chunked logits, under each remat of
`--remats` (auto: the planner's pick, e.g. `attention`, which keeps the attention's forward
results, where it fits, else full); the table gives the remat, tokens/s, MFU (attention FLOPs
included), peak memory, the compiled step's memory (XLA's temporaries on the device and in
host memory) and where the plan put the layer inputs (`config.offload.activations`), and the
longest length that trained. --device-gib caps the device memory the planner may use (a
shorter context then runs short of it as a longer one would). The step is compiled
before it runs, so `--warmup 0` times a first step that holds no compilation. --compile-only
builds, plans and compiles each length without running it: whether the step fits, and its
memory. --context N splits the sequence over N devices with ring attention, --sequence N with
Ulysses all-to-all (each device then runs cuDNN flash attention over the whole sequence for
1/N of the heads); it stops at the first length that fails.
"""

import argparse
import json
import sys

from throughput import ROOT, run_ours, write_results


def run_overrides(
    length: int,
    context: int,
    sequence: int,
    ring_blocks="auto",
    mlp_chunks=1,
    activations="auto",
    remat="auto",
    device_gib=0.0,
) -> list[str]:
    """One sequence of `length` tokens over context x sequence devices."""
    devices = context * sequence
    return [
        f"--config.train.seq_len={length}",
        "--config.train.batch_size=1",
        f"--config.mesh.context={context}",
        f"--config.mesh.sequence={sequence}",
        "--config.mesh.data=1",
        f"--config.model.remat={remat}",
        # About 8k positions per slice of logits (32000 x 8192 x 4 bytes = 1 GiB).
        f"--config.model.logits_chunks={max(1, length // devices // 8192)}",
        f"--config.model.ring_blocks={ring_blocks}",
        f"--config.model.mlp_chunks={mlp_chunks}",
        f"--config.offload.activations={activations}",
        f"--config.offload.device_gib={device_gib}",
        "--config.checkpoint.every_steps=0",
    ]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", default=str(ROOT / "configs/llama_1b.py"))
    p.add_argument("--context", type=int, default=1, help="ring attention over N devices")
    p.add_argument("--sequence", type=int, default=1, help="Ulysses all-to-all over N devices")
    p.add_argument("--start", type=int, default=32768)
    p.add_argument("--max", type=int, default=1 << 20)
    p.add_argument("--ring-blocks", default="auto", choices=("auto", "cudnn", "tokamax", "xla"))
    p.add_argument("--activations", default="auto", choices=("auto", "device", "host"))
    p.add_argument("--mlp-chunks", type=int, default=1, help="config.model.mlp_chunks")
    p.add_argument("--remats", default="auto", help="comma-separated config.model.remat values")
    p.add_argument(
        "--device-gib", type=float, default=0.0, help="config.offload.device_gib (0: the device's)"
    )
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--compile-only", action="store_true")
    p.add_argument("--out", default=str(ROOT / "runs/experiments/long_context.json"))
    args = p.parse_args()
    results, length, devices = [], args.start, args.context * args.sequence
    while length <= args.max:
        for remat in args.remats.split(","):
            overrides = run_overrides(
                length,
                args.context,
                args.sequence,
                args.ring_blocks,
                args.mlp_chunks,
                args.activations,
                remat,
                args.device_gib,
            )
            steps = -1 if args.compile_only else args.steps
            result = run_ours(args.config, overrides, steps=steps, warmup=args.warmup)
            results.append(
                {**result, "seq_len": length, "context": args.context, "sequence": args.sequence}
            )
            results[-1].update(activations=args.activations, mlp_chunks=args.mlp_chunks)
            results[-1]["asked_remat"] = remat
            print(json.dumps(results[-1]), flush=True)
            if "error" in result:
                results[-1]["fits"] = False
        if all("error" in r for r in results if r["seq_len"] == length):
            break
        length *= 2
    head = ("seq_len", "remat", "tokens/s", "MFU", "peak GiB", "temp GiB", "host temp", "inputs on")
    print("\n{:>9} {:>16} {:>10} {:>6} {:>9} {:>9} {:>9} {:>10}".format(*head))
    for r in results:
        if "error" in r:
            print(f"{r['seq_len']:>9} {r['asked_remat']:>16} failed: {r.get('error')}")
            continue
        tps, mfu = r.get("tokens_per_s"), r.get("mfu")
        remat = r["asked_remat"]
        remat = f"{remat} ({r['remat']})" if remat != r.get("remat", remat) else remat
        cells = (
            remat,
            f"{tps:,.0f}" if tps else "-",
            f"{mfu:.3f}" if mfu else "-",
            f"{r['peak_gib']:.1f}" if "peak_gib" in r else "-",
            f"{r.get('compiled_temp_gib', 0):.1f}",
            f"{r.get('compiled_host_temp_gib', 0):.1f}",
            "host" if r.get("layer_inputs_on_host") else "device",
        )
        print(f"{r['seq_len']:>9}", "{:>16} {:>10} {:>6} {:>9} {:>9} {:>9} {:>10}".format(*cells))
    done = [r["seq_len"] for r in results if "error" not in r]
    what = "compiled to fit" if args.compile_only else "trained"
    print(f"longest {what}: {max(done) if done else 'none'} tokens on {devices} device(s)")
    write_results(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
