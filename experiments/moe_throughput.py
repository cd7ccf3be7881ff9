"""Mixture-of-experts throughput: `moe_1b` per router beside the dense model of the same active
parameters, on one GPU or with expert parallel over several.

    python experiments/moe_throughput.py [--expert 1] [--dispatch-chunks 1,4] [--out FILE] \
        [-- --config.model.scan_layers=false ...]

Each run records the compiled step's custom calls (`kernels`; JAX's and tokamax's grouped
GEMMs are Mosaic GPU ones). MFU counts active parameters only (the experts a token goes
through, shared ones included), the convention of MaxText's MoE figures. The dense twin is
`llama_1b` with its MLP as wide as a token's active experts (experts_per_token +
shared_experts) x moe_ffn_dim, so both do the same matmul FLOPs per token. --expert N shards
the experts over N devices (the dense twin runs data parallel over the same N); the
per-device batch stays the same.
"""

import argparse
import json
import sys

from throughput import ROOT, print_table, run_ours, write_results


def moe_runs(
    expert: int,
    batch_per_device: int,
    routers: str,
    dispatch_chunks: str,
    kernels: str,
    overrides: list[str],
) -> list[tuple[str, str, list[str]]]:
    """(name, config, overrides) of each router's run (comma-separated arguments, as the
    flags give them) and of the dense twin."""
    sys.path.insert(0, str(ROOT))
    from angel_jax.config import load_config

    moe = load_config(str(ROOT / "configs/moe_1b.py"), []).model
    active_ffn = (moe.experts_per_token + moe.shared_experts) * moe.moe_ffn_dim
    batch = [f"--config.train.batch_size={batch_per_device * expert}", *overrides]
    runs = []
    for router in routers.split(","):
        dropless = router == "dropless"
        for chunks in ["1"] if dropless else dispatch_chunks.split(","):
            for kernel in kernels.split(",") if dropless else ["auto"]:
                label = f" ({kernel})"
                runs.append(
                    (
                        f"moe_1b {router}{label if dropless else ''} expert={expert}"
                        + (f" chunks={chunks}" if chunks != "1" else ""),
                        "configs/moe_1b.py",
                        [
                            *batch,
                            f"--config.model.router={router}",
                            f"--config.model.moe_dispatch_chunks={chunks}",
                            f"--config.model.moe_kernel={kernel}",
                            f"--config.mesh.expert={expert}",
                            "--config.mesh.data=1",
                        ],
                    )
                )
    runs.append(
        (
            f"dense twin (ffn {active_ffn}) data={expert}",
            "configs/llama_1b.py",
            [*batch, f"--config.model.ffn_dim={active_ffn}", f"--config.model.remat={moe.remat}"],
        )
    )
    return runs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--expert", type=int, default=1)
    p.add_argument("--batch-per-device", type=int, default=8)
    p.add_argument("--routers", default="topk,dropless,expert_choice")
    p.add_argument(
        "--dispatch-chunks",
        default="1",
        help="comma-separated config.model.moe_dispatch_chunks to run the capacity routers with",
    )
    p.add_argument(
        "--moe-kernels",
        default="auto",
        help="comma-separated config.model.moe_kernel to run dropless with "
        "(auto | jax_pallas | tokamax | xla)",
    )
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--no-twin", action="store_true", help="skip the dense twin")
    p.add_argument("overrides", nargs="*", help="config overrides for every run, after --")
    p.add_argument("--out", default=str(ROOT / "runs/experiments/moe_throughput.json"))
    a = p.parse_args()
    runs = moe_runs(
        a.expert, a.batch_per_device, a.routers, a.dispatch_chunks, a.moe_kernels, a.overrides
    )
    if a.no_twin:
        runs = runs[:-1]
    results = []
    for name, config, overrides in runs:
        timing = run_ours(str(ROOT / config), overrides, a.steps, warmup=2)
        results.append({**timing, "system": name, "overrides": overrides})
        print(json.dumps(results[-1]), flush=True)
        write_results(a.out, results)  # After each run: a run cut short keeps the others.
    print_table(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
