"""FP8 speed: FP8 matmuls against bf16 on the visible GPUs, and with two or more GPUs the FP8
ZeRO-3 collectives against XLA's bf16 ones, side by side in one job.

    python experiments/fp8_throughput.py [--config configs/llama_1b.py] [--out FILE] \
        [-- --config.model.num_layers=8 ...]

Every variant is its own process (throughput.py's worker) on the same shape and random tokens;
the table gives tokens/s, MFU, peak memory and each variant's ratio to the first (bf16) one,
and each record `f8_gemm_calls`: the FP8 cuBLAS GEMMs (`__cublas$lt$matmul$f8`) in the
compiled step. An FP8 variant with none ran the bf16 kernels, and says so.
"""

import argparse
import json
import sys

from throughput import ROOT, print_table, run_ours, write_results


def fp8_variants(devices: int, overrides: list[str]) -> tuple[list[str], list[tuple]]:
    """(overrides of every variant, [(name, its own overrides)]) on `devices` GPUs."""
    base = [f"--config.mesh.data={devices}"]
    if devices > 1:
        base.append("--config.zero_stage=3")
    base += overrides  # Last, so that they win.
    variants = [
        ("bf16", []),
        ("fp8 matmul", ["--config.fp8.matmul=true"]),
        ("fp8 matmul + lm head", ["--config.fp8.matmul=true", "--config.fp8.lm_head=true"]),
    ]
    if devices > 1:
        variants += [
            ("fp8 collectives", ["--config.fp8.collectives=true"]),
            ("fp8 both", ["--config.fp8.matmul=true", "--config.fp8.collectives=true"]),
        ]
    return base, variants


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", default=str(ROOT / "configs/llama_1b.py"))
    p.add_argument("--devices", type=int, default=1, help="data axis size (ZeRO-3 when > 1)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--out", default=str(ROOT / "runs/experiments/fp8_throughput.json"))
    p.add_argument("--only", default="", help="comma-separated variant names to run")
    p.add_argument("overrides", nargs="*", help="config overrides for every variant, after --")
    a = p.parse_args()
    base, variants = fp8_variants(a.devices, a.overrides)
    only = set(filter(None, a.only.split(",")))
    results = []
    for name, overrides in variants:
        if only and name not in only:
            continue
        timing = run_ours(a.config, [*base, *overrides], a.steps, warmup=3)
        f8_calls = timing.get("kernels", {}).get("__cublas$lt$matmul$f8", 0)
        results.append(
            {**timing, "system": name, "overrides": [*base, *overrides], "f8_gemm_calls": f8_calls}
        )
        print(json.dumps(results[-1]), flush=True)
        if "fp8 matmul" in name and "tokens_per_s" in timing and not f8_calls:
            print(f"warning: {name!r} compiled to no FP8 GEMM: it ran bf16 kernels", flush=True)
    print_table(results)
    for r in results:
        # What the step's collectives produce per device (`throughput.collective_bytes`).
        gathered = ", ".join(
            f"{kind} {n} x, {size / 1e6:,.1f} MB"
            for kind, (n, size) in r.get("collectives", {}).items()
        )
        print(f"{r['system']:<40} FP8 GEMM calls in the step: {r['f8_gemm_calls']}; {gathered}")
    write_results(a.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
