"""Capacity: the largest Llama-shaped model each ZeRO-Cache policy trains on this machine.

    python experiments/capacity.py [--d 5120 --ffn 13824 --heads 40 --kv 8] [--out FILE]

For each (optimizer, policy), the planner picks the deepest model at width `--d` whose states
fit the measured budgets; a child process then trains it for `--steps` steps on random tokens
and reports whether the loss stayed finite, the peak device memory, and the bytes of
(device + host) memory per parameter. Each run is its own process, so one failure (an
out-of-memory the planner did not foresee) is recorded and the next goes on.
"""

import argparse
import json
import math
import os
import resource
import sys
import time

from throughput import ROOT, run, write_results

CASES = [
    (optimizer, policy)
    for optimizer in ("adamw", "adafactor")
    for policy in ("none", "optimizer", "params", "auto")
]


def overrides(a, layers, optimizer, policy) -> list[str]:
    return [
        f"--config.model.num_layers={layers}",
        f"--config.model.d_model={a.d}",
        f"--config.model.ffn_dim={a.ffn}",
        f"--config.model.num_heads={a.heads}",
        f"--config.model.num_kv_heads={a.kv}",
        f"--config.model.vocab_size={a.vocab}",
        f"--config.train.batch_size={a.batch}",
        f"--config.train.seq_len={a.seq}",
        f"--config.train.optimizer={optimizer}",
        f"--config.offload.policy={policy}",
        "--config.model.remat=full",
        "--config.zero_stage=1",
        "--config.data.synthetic=true",
        f"--config.offload.device_gib={a.device_gib}",
        f"--config.offload.host_gib={a.host_gib}",
        f"--config.offload.ssd_dir={a.ssd_dir}",
        f"--config.offload.ssd_gib={a.ssd_gib}",
        f"--config.offload.ssd_compress={a.ssd_compress}",
        "--config.checkpoint.every_steps=0",
    ]


def deepest(a, optimizer, policy) -> tuple[int, dict] | None:
    """The most layers the planner accepts, and that plan (None if even 1 layer does not fit)."""
    sys.path.insert(0, str(ROOT))
    import jax

    from angel_jax.config import ConfigError, load_config
    from angel_jax.mesh import make_mesh
    from angel_jax.train import build

    def plan(layers):
        config = load_config(a.config, overrides(a, layers, optimizer, policy))
        try:  # The plan alone: the compiled step is checked below, once.
            mesh = make_mesh(config.mesh, jax.devices()[:1])
            return build(config, mesh, fit_compiled=False).plan
        except ConfigError:
            return None

    lo, hi = 0, 1
    while plan(hi) is not None and hi < 4096:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if plan(mid) is not None else (lo, mid)
    if lo == 0:
        return None
    # On a GPU, `build` also checks the compiled step's memory (its temporaries, not the
    # planner's activation estimate; `auto` plans again with them): step down until it fits.
    refused = []
    while True:
        config = load_config(a.config, overrides(a, lo, optimizer, policy))
        try:
            exp = build(config, make_mesh(config.mesh, jax.devices()[:1]))
            if jax.default_backend() != "cpu":
                _ = exp.train_step  # Compiles.
            break
        except ConfigError as e:
            refused.append(dict(layers=lo, error=str(e)))
            lo = min(lo - 1, int(lo * 0.95))
            if lo == 0 or len(refused) == 5:
                return None
    p = exp.plan
    from angel_jax.planning import tiers

    return lo, dict(
        # The pinned-host pool's settings that hold this plan (tiers.pool_advice).
        pool=tiers.pool_advice(p, 1),
        refused_by_compiled_check=refused,
        params=p.num_params,
        planned_device_gib=p.tier_bytes("device") / 2**30,
        planned_host_gib=p.tier_bytes("pinned_host") / 2**30,
        bytes_per_param=p.bytes_per_param(),
    )


def memory_report(event: str) -> None:
    """One stderr line of the device's peak and this process's peak resident host memory: the
    child's log tells which tier ran out if it dies (exit -9 is the kernel's OOM killer)."""
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB.
    device = stats.get("peak_bytes_in_use", 0) / 2**30
    print(f"{event}: device peak {device:.1f} GiB, host peak RSS {rss:.1f} GiB", file=sys.stderr)
    try:  # Where the resident memory is: anonymous, shared, file-backed, locked (pinned).
        with open("/proc/self/smaps_rollup") as f:
            kinds = {
                k: int(v.split()[0]) / 2**20
                for k, v in (line.split(":", 1) for line in f)
                if k in ("Rss", "Anonymous", "Shared_Clean", "Shared_Dirty", "Locked")
            }
        print("  now, GiB: " + ", ".join(f"{k} {v:.1f}" for k, v in kinds.items()), file=sys.stderr)
    except (OSError, ValueError):
        pass


def child(a, layers, optimizer, policy) -> dict:
    sys.path.insert(0, str(ROOT))
    import jax

    from angel_jax.config import load_config
    from angel_jax.data import make_batches
    from angel_jax.mesh import make_mesh
    from angel_jax.train import build

    config = load_config(a.config, overrides(a, layers, optimizer, policy))
    exp = build(config, make_mesh(config.mesh, jax.devices()[:1]))
    print(exp.plan.table(), file=sys.stderr, flush=True)
    train_step = exp.train_step  # Compiled before the state takes the device's memory.
    memory_report("compiled")
    state = exp.init_state()
    memory_report("state initialised")
    init_rss_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    batches = make_batches(config).iterate(0)
    losses, start = [], time.perf_counter()
    for step in range(a.steps):
        state, metrics = train_step(state, exp.global_batch(next(batches)))
        losses.append(float(metrics["loss"]))
        memory_report(f"step {step + 1}, loss {losses[-1]:.4f}")
    stats = jax.devices()[0].memory_stats() or {}
    return dict(
        losses=losses,
        finite=all(math.isfinite(x) for x in losses),
        seconds=time.perf_counter() - start,
        peak_device_gib=stats.get("peak_bytes_in_use", 0) / 2**30,
        # Peak resident host memory by the end of the initialisation and of the run (on a CPU
        # the device tier is host memory too, so these then hold both).
        init_host_rss_gib=init_rss_gib,
        peak_host_rss_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", default=str(ROOT / "configs/llama_1b.py"))
    for name, default in dict(
        d=5120, ffn=13824, heads=40, kv=8, vocab=32000, batch=1, seq=2048
    ).items():
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--device-gib", type=float, default=0.0, help="budget; 0: measured")
    p.add_argument("--host-gib", type=float, default=0.0, help="budget; 0: measured")
    p.add_argument("--ssd-dir", default="", help="SSD tier directory (policy auto); '': none")
    p.add_argument("--ssd-gib", type=float, default=0.0, help="SSD budget; 0: free space")
    p.add_argument("--ssd-compress", action="store_true", help="optimizer state in bf16 on disk")
    p.add_argument("--only", default="", help="e.g. adamw/optimizer")
    p.add_argument("--out", default=str(ROOT / "runs/experiments/capacity.json"))
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    p.add_argument("--search", nargs=2, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        layers, optimizer, policy = int(a.child[0]), a.child[1], a.child[2]
        print(json.dumps(child(a, layers, optimizer, policy)), flush=True)
        return 0
    if a.search:
        found = deepest(a, *a.search)
        out = {"error": "no depth fits the budgets"} if found is None else {"layers": found[0]}
        print(json.dumps(out if found is None else {**out, **found[1]}))
        return 0

    results = []
    for optimizer, policy in CASES:
        if a.only and f"{optimizer}/{policy}" not in a.only.split(","):
            continue
        # The search runs in a process of its own too: this one must not start a GPU
        # client, which would hold the device memory the training child needs.
        search = [sys.executable, __file__, *sys.argv[1:], "--search", optimizer, policy]
        found = run(search, ROOT)
        row = dict(optimizer=optimizer, policy=policy)
        if not found or "error" in found:
            results.append({**row, "error": (found or {}).get("error", "no depth fits")})
            continue
        cmd = [sys.executable, __file__, *sys.argv[1:], "--child", str(found["layers"])]
        log = f"{a.out.removesuffix('.json')}.{optimizer}-{policy}.log"
        # XLA's pinned-host pool keeps the regions it grows up to its cap: the child takes the
        # settings the plan advises, which hold its arrays (tiers.pool_advice).
        env = None
        if found.get("pool"):
            env = {**os.environ, **dict(s.split("=") for s in found["pool"].split())}
        measured = run(cmd + [optimizer, policy], ROOT, log, env)
        results.append({**row, **found, **measured, "log": log})
        print(json.dumps(results[-1]), flush=True)

    header = ("optimizer/policy", "layers", "params", "B/param", "peak GiB")
    print("\n{:<22} {:>6} {:>9} {:>8} {:>9}  trained".format(*header))
    for r in results:
        if "params" not in r:
            print(f"{r['optimizer'] + '/' + r['policy']:<22} {r.get('error')}")
            continue
        ok = "yes" if r.get("finite") else f"no: {r.get('error', 'non-finite loss')}"
        peak = r.get("peak_device_gib", float("nan"))
        print(
            f"{r['optimizer'] + '/' + r['policy']:<22} {r['layers']:>6} {r['params'] / 1e9:>8.2f}B "
            f"{r['bytes_per_param']:>8.1f} {peak:>9.1f}  {ok}"
        )
    write_results(a.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
