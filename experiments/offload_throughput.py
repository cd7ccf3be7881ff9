"""ZeRO-Cache offload on one GPU: step time, memory and losses per policy, in one job.

    python experiments/offload_throughput.py [--out runs/experiments/offload_throughput.json]

Every run checks that the offloaded policy gives the same losses as `none` on the same data
(XLA has had wrong-gradient bugs in offloaded programs on GPU), and reports the peak device
memory each policy needs.

`--steps -1` plans and compiles each variant without running it (`throughput.child`), with
COMPILE_FOR_DEVICES=1 also on a machine without a GPU (`throughput.compile_only_devices`):

    COMPILE_FOR_DEVICES=1 GPU_TARGET_CONFIG=experiments/gpu_targets/h200.txtpb GPU_HOST_GIB=120 \
      JAX_PLATFORMS=cpu python experiments/offload_throughput.py --steps -1 --only NAME \
      -- --config.offload.device_gib=132.81
"""

import argparse
import json
import sys
import time

from throughput import ROOT, run, run_ours, write_results

# (name, config, overrides, steps timed or None for the default); steps=0 times the one
# broken-down step instead.
OPT = ["--config.offload.policy=optimizer"]
DEVICE_UPDATE = [*OPT, "--config.offload.cpu_update=0"]  # The device updates every chunk.
AUTO = ["--config.offload.policy=auto"]
HYBRID = [*OPT, "--config.offload.cpu_update=-1"]  # The share picked from measured rates.
IN_FLIGHT_8 = ["--config.offload.chunks_in_flight=8"]
# Every chunk (llama_1b has 201) fetched before the step and sent home beside the next one.
ALL_IN_FLIGHT = ["--config.offload.chunks_in_flight=1000"]
DELAYED = ["--config.offload.delayed_update=true"]  # Stale by one step (docs/zero-cache.md).
MICRO_4 = ["--config.train.batch_size=32", "--config.train.microbatches=4"]
MICRO_4_OF_8 = ["--config.train.microbatches=4"]  # llama_1b's 8 x 2048 in 4 microbatches.
# The masters kept whole in host memory (before config.offload.split_masters, the default).
WHOLE_MASTERS = ["--config.offload.split_masters=false"]
BF16_MU = ["--config.train.mu_dtype=bfloat16"]  # AdamW's first moment (changes the math).
# The remat the 8B rows measured before the config took auto.
DOTS_NO_BATCH = ["--config.model.remat=dots_no_batch"]
# The ZeRO-Cache issue's 8B benchmark shape: 16 x 8192 tokens (128k) a step.
TOKENS_128K = ["--config.zero_stage=1", "--config.train.batch_size=16"]
# fp32 masters + Adam state are 90 GiB: on the device alone they leave no room to train.
# About 1M tokens per step, as in the ZeRO-Cache issue's benchmark: 128 x 8192 tokens.
BIG = ["--config.zero_stage=1", "--config.train.batch_size=128", *DOTS_NO_BATCH]
FP8 = ["--config.fp8.matmul=true", "--config.fp8.lm_head=true"]
# The update inside the step's program (config.offload.update_in_step) and its references: the
# layers unrolled for all, and no clipping (without it a layer's update need not wait for the
# global grad norm, that is for the whole backward pass: docs/zero-cache.md "The update").
UNROLLED = ["--config.model.scan_layers=false"]
NO_CLIP = [*UNROLLED, "--config.train.grad_clip=0"]
IN_STEP = ["--config.offload.update_in_step=true"]
BATCH_32 = ["--config.train.batch_size=32"]  # One microbatch: a longer backward to hide in.
# Clipping on, never reached (llama_1b's first steps' norms are about 1.4): the speculative
# update's speculation holds (config.offload.speculative_update).
CLIP_UNREACHED = [*UNROLLED, "--config.train.grad_clip=10000"]
SPECULATIVE = [*IN_STEP, "--config.offload.speculative_update=true"]
# (name, config, overrides, steps timed or None for the default); steps=0 times the one
# broken-down step instead. "hybrid": the host's cores update a share of the chunks
# (config.offload.cpu_update; -1: the planner's share from measured rates).
VARIANTS = [
    ("llama_1b none", "llama_1b", ["--config.offload.policy=none"], None),
    ("llama_1b optimizer, device update", "llama_1b", DEVICE_UPDATE, None),
    (
        "llama_1b optimizer, device update, 8 in flight",
        "llama_1b",
        DEVICE_UPDATE + IN_FLIGHT_8,
        None,
    ),
    ("llama_1b optimizer, hybrid", "llama_1b", HYBRID, None),
    ("llama_1b optimizer, hybrid, 8 in flight", "llama_1b", HYBRID + IN_FLIGHT_8, None),
    (
        "llama_1b optimizer, hybrid 25%, 8 in flight",
        "llama_1b",
        [*OPT, *IN_FLIGHT_8, "--config.offload.cpu_update=0.25"],
        None,
    ),
    (
        "llama_1b optimizer, hybrid 40%, 8 in flight",
        "llama_1b",
        [*OPT, *IN_FLIGHT_8, "--config.offload.cpu_update=0.4"],
        None,
    ),
    *(
        (
            f"llama_1b optimizer, device update, {n} in flight",
            "llama_1b",
            [*DEVICE_UPDATE, f"--config.offload.chunks_in_flight={n}"],
            None,
        )
        for n in (32, 64)
    ),
    (
        "llama_1b optimizer, device update, all in flight",
        "llama_1b",
        DEVICE_UPDATE + ALL_IN_FLIGHT,
        None,
    ),
    (
        "llama_1b optimizer, delayed, device update, all in flight",
        "llama_1b",
        DEVICE_UPDATE + ALL_IN_FLIGHT + DELAYED,
        None,
    ),
    (
        "llama_1b optimizer, delayed, host 40%, all in flight",
        "llama_1b",
        [*OPT, *ALL_IN_FLIGHT, "--config.offload.cpu_update=0.4", *DELAYED],
        None,
    ),
    (
        "llama_1b optimizer, delayed, device update, 8 in flight",
        "llama_1b",
        DEVICE_UPDATE + IN_FLIGHT_8 + DELAYED,
        None,
    ),
    (
        "llama_1b optimizer, delayed, host 50%, 8 in flight",
        "llama_1b",
        [*OPT, *IN_FLIGHT_8, "--config.offload.cpu_update=0.5", *DELAYED],
        None,
    ),
    (
        "llama_1b optimizer, delayed, host 100%",
        "llama_1b",
        [*OPT, "--config.offload.cpu_update=1", *DELAYED],
        None,
    ),
    # 4 x 8 x 2048 tokens a step: the update's copies (14.4 GB each way, more than the host's
    # memory and the link move in one 8 x 2048 step's compute) amortised over 4 microbatches.
    ("llama_1b/32x2048 none", "llama_1b", [*MICRO_4, "--config.offload.policy=none"], None),
    # The 8 x 2048 in 4 microbatches: the delayed update between them moves 11 GB
    # each way with split masters (13.2 whole), against about 0.23 s of compute.
    (
        "llama_1b/8x2048 in 4 none",
        "llama_1b",
        [*MICRO_4_OF_8, "--config.offload.policy=none"],
        None,
    ),
    (
        "llama_1b/8x2048 in 4 optimizer, delayed, device update",
        "llama_1b",
        [*MICRO_4_OF_8, *DEVICE_UPDATE, *DELAYED],
        None,
    ),
    (
        "llama_1b/8x2048 in 4 optimizer, delayed, device update, whole masters",
        "llama_1b",
        [*MICRO_4_OF_8, *DEVICE_UPDATE, *DELAYED, *WHOLE_MASTERS],
        None,
    ),
    (  # AdamW's first moment in bfloat16 (changes the math): 8 bytes each way a parameter.
        "llama_1b/8x2048 in 4 optimizer, delayed, device update, bf16 mu",
        "llama_1b",
        [*MICRO_4_OF_8, *DEVICE_UPDATE, *DELAYED, *BF16_MU],
        None,
    ),
    (
        "llama_1b optimizer, device update, 8 in flight, bf16 mu",
        "llama_1b",
        [*DEVICE_UPDATE, *IN_FLIGHT_8, *BF16_MU],
        None,
    ),
    (
        "llama_1b optimizer, device update, 8 in flight, whole masters",
        "llama_1b",
        [*DEVICE_UPDATE, *IN_FLIGHT_8, *WHOLE_MASTERS],
        None,
    ),
    (
        "llama_1b/32x2048 optimizer, device update, 8 in flight",
        "llama_1b",
        [*MICRO_4, *DEVICE_UPDATE, *IN_FLIGHT_8],
        None,
    ),
    (
        "llama_1b/32x2048 optimizer, device update, all in flight",
        "llama_1b",
        [*MICRO_4, *DEVICE_UPDATE, *ALL_IN_FLIGHT],
        None,
    ),
    (  # Stale by one step: the update runs between the next step's microbatches.
        "llama_1b/32x2048 optimizer, delayed, device update",
        "llama_1b",
        [*MICRO_4, *DEVICE_UPDATE, *DELAYED],
        None,
    ),
    ("llama_1b/32x2048/unrolled/noclip none", "llama_1b", [*NO_CLIP, *BATCH_32], None),
    (
        "llama_1b/32x2048/unrolled/noclip optimizer, streamed, 8 in flight",
        "llama_1b",
        [*DEVICE_UPDATE, *IN_FLIGHT_8, *NO_CLIP, *BATCH_32],
        None,
    ),
    (
        "llama_1b/32x2048/unrolled/noclip optimizer, in step, 8 in flight",
        "llama_1b",
        [*DEVICE_UPDATE, *IN_FLIGHT_8, *IN_STEP, *NO_CLIP, *BATCH_32],
        None,
    ),
    (
        "llama_1b/32x2048/unrolled optimizer, in step, 8 in flight, clipped",
        "llama_1b",
        [*DEVICE_UPDATE, *IN_FLIGHT_8, *IN_STEP, *UNROLLED, *BATCH_32],
        None,
    ),
    ("llama_1b/unrolled/clip unreached none", "llama_1b", CLIP_UNREACHED, None),
    (
        "llama_1b/unrolled/clip unreached optimizer, in step, 8 in flight, speculative",
        "llama_1b",
        [*DEVICE_UPDATE, *IN_FLIGHT_8, *SPECULATIVE, *CLIP_UNREACHED],
        None,
    ),
    (
        "llama_1b/unrolled/clip unreached optimizer, streamed, 8 in flight",
        "llama_1b",
        [*DEVICE_UPDATE, *IN_FLIGHT_8, *CLIP_UNREACHED],
        None,
    ),
    ("llama_1b/unrolled/noclip none", "llama_1b", NO_CLIP, None),
    (
        "llama_1b/unrolled/noclip optimizer, streamed, 8 in flight",
        "llama_1b",
        [*DEVICE_UPDATE, *IN_FLIGHT_8, *NO_CLIP],
        None,
    ),
    (
        "llama_1b/unrolled/noclip optimizer, in step, 8 in flight",
        "llama_1b",
        [*DEVICE_UPDATE, *IN_FLIGHT_8, *IN_STEP, *NO_CLIP],
        None,
    ),
    ("llama_1b params", "llama_1b", ["--config.offload.policy=params"], None),
    (
        "llama_1b params, 2 microbatches",
        "llama_1b",
        ["--config.offload.policy=params", "--config.train.microbatches=2"],
        None,
    ),
    (
        "llama_1b optimizer, 2 microbatches",
        "llama_1b",
        [*OPT, "--config.train.microbatches=2"],
        None,
    ),
    (
        "llama3_8b optimizer, 128 x 8192 in 128 microbatches, device update",
        "llama3_8b",
        [*DEVICE_UPDATE, *BIG, "--config.train.microbatches=128"],
        0,
    ),
    (
        "llama3_8b optimizer, 128 x 8192 in 128 microbatches, fp8 matmul + lm head, device update",
        "llama3_8b",
        [*DEVICE_UPDATE, *BIG, "--config.train.microbatches=128", *FP8],
        0,
    ),
    (
        "llama3_8b optimizer, 128 x 8192 in 64 microbatches, fp8 matmul + lm head, device update",
        "llama3_8b",
        [*DEVICE_UPDATE, *BIG, "--config.train.microbatches=64", *FP8],
        0,
    ),
    (
        "llama3_8b fp8 hybrid, 128 x 8192 in 128 microbatches, fp8 matmul + lm head",
        "llama3_8b",
        [*HYBRID, *BIG, "--config.train.microbatches=128", *FP8],
        0,
    ),
    (
        "llama3_8b fp8 hybrid, 128 x 8192 in 64 microbatches, fp8 matmul + lm head",
        "llama3_8b",
        [*HYBRID, *BIG, "--config.train.microbatches=64", *FP8],
        0,
    ),
    (
        "llama3_8b optimizer, 16 x 8192 in 16 microbatches, device update",
        "llama3_8b",
        [*DEVICE_UPDATE, *TOKENS_128K, "--config.train.microbatches=16", *DOTS_NO_BATCH],
        0,
    ),
    # auto: the device's spare room (31 GiB here, once the compiled step's temporaries are
    # counted) keeps chunks resident; the host's cores take a share of the rest. (Every chunk
    # on the host's cores, 96 GB in plain host memory beside the pinned pool, does not fit the
    # 125 GiB machine: the planner refuses it.)
    (
        "llama3_8b auto, 16 x 8192 in 16 microbatches, device update",
        "llama3_8b",
        [*AUTO, "--config.offload.cpu_update=0", *TOKENS_128K, "--config.train.microbatches=16"],
        0,
    ),
    (  # The remat the 8B config had before it took auto: the last one's reference.
        "llama3_8b auto, 16 x 8192 in 16 microbatches, device update, remat dots_no_batch",
        "llama3_8b",
        [
            *AUTO,
            "--config.offload.cpu_update=0",
            *TOKENS_128K,
            "--config.train.microbatches=16",
            *DOTS_NO_BATCH,
        ],
        0,
    ),
    (  # Stale by one step: the update runs between the next step's microbatches, timed.
        "llama3_8b auto, 16 x 8192 in 16 microbatches, delayed, device update",
        "llama3_8b",
        [
            *AUTO,
            "--config.offload.cpu_update=0",
            *TOKENS_128K,
            "--config.train.microbatches=16",
            *DELAYED,
        ],
        None,
    ),
    (
        "llama3_8b auto, 16 x 8192 in 16 microbatches, host 30%",
        "llama3_8b",
        [
            *AUTO,
            "--config.offload.cpu_update=0.3",
            *TOKENS_128K,
            "--config.train.microbatches=16",
            *DOTS_NO_BATCH,
        ],
        0,
    ),
    (
        "llama3_8b auto, 16 x 8192 in 16 microbatches, delayed, host 30%",
        "llama3_8b",
        [
            *AUTO,
            "--config.offload.cpu_update=0.3",
            *TOKENS_128K,
            "--config.train.microbatches=16",
            *DELAYED,
            *DOTS_NO_BATCH,
        ],
        2,
    ),
]


def copy_rates(gib: int = 4) -> dict:
    """GB/s of runtime host<->device copies of `gib` GiB in 256 MiB pieces: each way alone, and
    both at once (what the streamed update's copies can reach)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    d = jax.devices()[0]
    device, host = SingleDeviceSharding(d), SingleDeviceSharding(d, memory_kind="pinned_host")
    pieces = 4 * gib
    on_host = [jax.device_put(jnp.ones(2**26, jnp.float32), host) for _ in range(pieces)]
    on_device = [jnp.ones(2**26, jnp.float32) for _ in range(pieces)]
    cases = dict(
        h2d=lambda: [jax.device_put(x, device) for x in on_host],
        d2h=lambda: [jax.device_put(x, host) for x in on_device],
        both=lambda: [
            jax.device_put(x, s)
            for pair in zip(on_host, on_device, strict=True)
            for x, s in zip(pair, (device, host), strict=True)
        ],
    )
    out = {}
    for name, fn in cases.items():
        jax.block_until_ready(fn())  # Warm up: the pinned pool grows on first use.
        times = []
        for _ in range(3):
            start = time.perf_counter()
            jax.block_until_ready(fn())
            times.append(time.perf_counter() - start)
        out[f"{name}_gbps_each_way"] = gib * 2**30 / 1e9 / min(times)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default=str(ROOT / "runs/experiments/offload_throughput.json"))
    p.add_argument(
        "--only",
        default="",
        help="';'-separated: run the variants whose name contains one (or is one, after '=')",
    )
    p.add_argument(
        "--baselines", help="directory of the peer baselines: runs hf_deepspeed_offload.py too"
    )
    p.add_argument("--copy-rates", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help="config overrides for every variant, after --")
    args = p.parse_args()
    if args.copy_rates:
        print(json.dumps(copy_rates()), flush=True)
        return 0
    results = [{"system": "copy rates"}]  # Nothing is copied when nothing runs.
    if args.steps >= 0:
        results[0].update(run([sys.executable, __file__, "--copy-rates"], ROOT))
        print("host<->device copies:", json.dumps(results[0]), flush=True)
    for name, config, overrides, steps in VARIANTS:
        parts = args.only.split(";")
        if args.only and not any(name == p[1:] if p[:1] == "=" else p in name for p in parts):
            continue
        config_path = str(ROOT / "configs" / f"{config}.py")
        # Every variant times steps after --warmup ones: the pinned-host pool grows (cuMemHostAlloc,
        # 2.4 GB/s on the H200) as late as the second step, and a timed step that grows it is not
        # the steady state (profile, 2026-12-03: 13.8 s of a 29 s 8B step).
        steps = args.steps if steps is None or args.steps < 0 else steps
        overrides = [*overrides, *args.overrides]
        timing = run_ours(config_path, overrides, steps, args.warmup)
        results.append({**timing, "system": name, "overrides": overrides})
        print(json.dumps(results[-1]), flush=True)

    if args.baselines:  # DeepSpeed ZeRO-2 with CPU Adam: the peer of policy=optimizer.
        cmd = [sys.executable, "hf_deepspeed_offload.py"]
        peer = run(cmd, args.baselines)
        results.append({**peer, "system": "deepspeed zero-2, optimizer on the CPU (peer)"})
        print(json.dumps(results[-1]), flush=True)
    ref = {r["system"].split()[0]: r for r in results if r["system"].endswith(" none")}
    head = ("variant", "step s", "tokens/s", "MFU", "peak GiB", "fwd+bwd", "update", "GB/s")
    print("\n{:<52} {:>7} {:>9} {:>6} {:>8} {:>7} {:>7} {:>6}  losses".format(*head))
    for r in results[1:]:
        if r.get("fits"):  # Planned and compiled only.
            print(
                f"{r['system']:<52} compiled: planned {r['planned_device_gib']:.1f} GiB, "
                f"temporaries {r['compiled_temp_gib']:.1f} GiB, kernels {r['kernels']}"
            )
            continue
        if "tokens_per_s" not in r:
            print(f"{r['system']:<40} failed: {r.get('error')}")
            continue
        if "warmup_losses" not in r:  # The peer.
            print(f"{r['system']:<52} {r['step_s']:>7.3f} {r['tokens_per_s']:>9,.0f} ")
            continue
        base = ref.get(r["system"].split()[0])
        same = ""
        if base is not None and base is not r:
            pairs = zip(r["warmup_losses"], base["warmup_losses"], strict=True)
            diff = max(abs(a - b) / abs(b) for a, b in pairs)
            same = f" (vs none: max rel. diff {diff:.1e}{'' if diff < 1e-3 else ', TOO LARGE'})"
        losses = ", ".join(f"{x:.4f}" for x in r["warmup_losses"])
        parts = "{:>7} {:>7} {:>6}".format(
            *(f"{r[k]:.3f}" if k in r else "-" for k in ("compute_s", "update_s")),
            f"{r['update_gbps_each_way']:.1f}" if "update_s" in r else "-",
        )
        print(
            f"{r['system']:<52} {r['step_s']:>7.3f} {r['tokens_per_s']:>9,.0f} "
            f"{r['mfu']:>6.3f} {r['peak_gib']:>8.1f} {parts}  {losses}{same}"
        )
    write_results(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
