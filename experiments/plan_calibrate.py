"""Calibrates the run planner's compute model (angel_jax/planning/cost_model.py) on one GPU: times a
transformer layer's forward + backward at the shard shapes each tensor-parallel size gives (the
heads, KV heads and FFN split over tp, the model dim whole), in bf16 with cuDNN attention, and
writes the efficiency points the planner reads (experiments/calibration/<gpu>.json).

    python experiments/plan_calibrate.py --config configs/llama3_70b.py --out calib.json
    python experiments/plan_calibrate.py --from-records h100     # the default, from the records

A layer's time is the difference of a model with 3 layers and one with 1 (embedding and final
norm cancel; no LM head, no optimizer), each step timed after a warm-up. Its efficiency is the
layer's FLOPs (6 x its matmul params + 3 x causal attention, per token) over the peak. At the
sizes --fp8-tp names (4 by default) it also times the layer with FP8 matmuls, for the planner's
FP8 speed-up by shard size. `--profile` adds each layer's GPU time by kind of kernel (matmul,
attention, fusions: experiments/profile_step.py's kinds) to its row, from a trace of the two models.
"""

import argparse
import dataclasses
import datetime
import json
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def layer_seconds(config, tokens: int, layers: int, reps: int, profile: bool = False):
    """Seconds of a forward + backward of config.model with `layers` layers over `tokens`
    tokens (one sequence), the final normed states summed (no LM head), params in bf16; with
    `profile` also the kernels of one such step (`kernel_seconds`), from a trace of `reps` more."""
    import jax
    import jax.numpy as jnp

    from angel_jax.models import family_of

    model = config.model
    model.num_layers = layers
    family = family_of(model)
    cfg = family.make_config(model, jax.default_backend())
    if config.fp8.matmul:  # As the trainer's build sets it (train.py).
        cfg = dataclasses.replace(cfg, fp8_matmul=True)
    module = family.module(cfg)
    ids = jnp.zeros((1, tokens), jnp.int32)
    params = jax.jit(lambda: module.init(jax.random.key(0), ids)["params"])()
    params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)

    def grads(p):
        loss = lambda p: module.apply({"params": p}, ids, hidden=True).astype(jnp.float32).sum()
        return jax.grad(loss)(p)

    step = jax.jit(grads).lower(params).compile()

    jax.block_until_ready(step(params))
    start = time.perf_counter()
    for _ in range(reps):
        out = step(params)
    jax.block_until_ready(out)
    seconds = (time.perf_counter() - start) / reps
    if not profile:
        return seconds
    return seconds, kernel_seconds(step, params, reps)


def kernel_seconds(step, params, reps: int) -> dict:
    """{kernel kind: seconds a step} and the top kernels' seconds a step, from a profiler trace
    of `reps` calls of `step`."""
    import gzip
    import shutil
    import tempfile

    import jax
    from profile_step import summarize

    trace_dir = pathlib.Path(tempfile.mkdtemp(prefix="angel_calibrate_"))
    with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
        for _ in range(reps):
            out = step(params)
        jax.block_until_ready(out)
    with gzip.open(next(trace_dir.rglob("perfetto_trace.json.gz"))) as f:
        summary = summarize(json.load(f), reps, step.as_text(), top=15)
    shutil.rmtree(trace_dir)
    top = [
        (t["kind"], t["hlo_op"], t["ms_per_step"] / 1e3, t["source"][-90:]) for t in summary["top"]
    ]
    return dict(
        by_kind={kind: ms / 1e3 for kind, ms in summary["ms_per_step_by_kind"].items()}, top=top
    )


# Kernel kinds (profile_step.py's) a tensor split leaves whole in the timed shard: the rest
# (norms, residual adds, casts, copies) sequence parallel splits tp ways.
SPLIT_BY_HEADS = ("matmul", "attention (cuDNN)")


def sequence_parallel(rows: list[dict], profiled: list[dict] | None = None) -> None:
    """Adds to each row its layer's time and efficiency as sequence parallel runs the shard:
    `layer_sp_s` = its matmul and attention kernels, which the shard times at their split
    widths, plus the rest of the same variant's tp 1 layer over tp. The timed shard runs the
    norm regions on the whole sequence, and under FP8 quantizes whole inputs; in a run each
    rank holds 1/tp of the sequence there (FP8's inputs are cast on that split before their
    gather, fp8.gather_quantized).

    A row's rest is its own profile's (`kernel_s_by_kind`); else, from `profiled` rows of its
    variant (default `rows`) at tp 1 and a wider tp, rest(tp) = a + b / tp: the norm regions,
    whole in every timed shard (a), and what splits with the heads (b). Rows of a variant
    without a profiled tp 1 are left as they are."""
    profiled = [r for r in (rows if profiled is None else profiled) if "kernel_s_by_kind" in r]
    rest = lambda r: sum(s for k, s in r["kernel_s_by_kind"].items() if k not in SPLIT_BY_HEADS)
    for variant in {r["variant"] for r in profiled if r["tp"] == 1}:
        one = rest(next(r for r in profiled if r["variant"] == variant and r["tp"] == 1))
        wider = [r for r in profiled if r["variant"] == variant and r["tp"] > 1]
        b = None
        if wider:
            far = max(wider, key=lambda r: r["tp"])
            b = (one - rest(far)) / (1 - 1 / far["tp"])
        for r in (r for r in rows if r["variant"] == variant):
            if "kernel_s_by_kind" in r:
                timed, r["rest_from"] = rest(r), "profile"
            elif b is not None:
                timed, r["rest_from"] = one - b + b / r["tp"], "a + b / tp"
            else:
                continue
            r["layer_sp_s"] = r["layer_s"] - timed + one / r["tp"]
            if "efficiency" in r:
                r["efficiency_sp"] = r["efficiency"] * r["layer_s"] / r["layer_sp_s"]


def measure(
    config_path: str,
    tps: list[int],
    fp8_tps: list[int],
    seq_len: int,
    reps: int,
    gpu: str,
    profile: bool = False,
) -> dict:
    import jax

    from angel_jax.config import load_config
    from angel_jax.plan import model_shape
    from angel_jax.planning import cost_model

    peak = cost_model.GPUS[gpu].peak_tflops * 1e12
    points, extra = [], {}
    for tp in tps:
        variants = [("bf16", [])]
        if tp in fp8_tps:
            variants += [("fp8", ["--config.fp8.matmul=true"])]
        base = load_config(config_path)
        shard = [
            f"--config.model.num_heads={base.model.num_heads // tp}",
            f"--config.model.num_kv_heads={max(base.model.num_kv_heads // tp, 1)}",
            f"--config.model.ffn_dim={base.model.ffn_dim // tp}",
            f"--config.model.head_dim={base.model.d_model // base.model.num_heads}",
            "--config.model.remat=none",
            f"--config.train.seq_len={seq_len}",
        ]
        for name, over in variants:
            config = load_config(config_path, [*shard, *over])
            shape = model_shape(config.model)
            mm, att = 2 * shape.layer_matmul_params(), shape.layer_attention_flops(seq_len)
            three, one = (layer_seconds(config, seq_len, n, reps, profile) for n in (3, 1))
            if profile:
                (three, kinds3), (one, kinds1) = three, one
            t = (three - one) / 2
            flops = seq_len * 3 * (mm + att)
            row = dict(
                tp=tp,
                variant=name,
                layer_params_per_device=shape.layer_matmul_params(),
                layer_s=t,
                efficiency=flops / (t * peak),
            )
            if profile:  # A layer's kernels: the 3-layer model's less the 1-layer's, halved.
                by3, by1 = kinds3["by_kind"], kinds1["by_kind"]
                row["kernel_s_by_kind"] = {k: (by3[k] - by1.get(k, 0.0)) / 2 for k in by3}
                row["top_kernels_3_layers"] = kinds3["top"]
            print(json.dumps(row), flush=True)
            if name == "bf16":
                points.append(row)
            extra[(tp, name)] = row
    sequence_parallel(list(extra.values()))
    out = dict(
        gpu=gpu,
        device=jax.devices()[0].device_kind,
        jax=jax.__version__,
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        config=config_path,
        seq_len=seq_len,
        points=points,
    )
    fp8 = [fp8_point(extra[tp, "bf16"], extra[tp, "fp8"]) for tp in tps if (tp, "fp8") in extra]
    if fp8:
        out["fp8_points"] = fp8
        out["fp8_speedup"] = next((p for p in fp8 if p["tp"] == 4), fp8[0])["speedup"]
    return out


def fp8_point(bf16: dict, fp8: dict) -> dict:
    """FP8's speed-up of one shard, timed and (where profiled) as sequence parallel runs it."""
    point = dict(
        tp=bf16["tp"],
        layer_params_per_device=bf16["layer_params_per_device"],
        speedup=bf16["layer_s"] / fp8["layer_s"],
    )
    if "layer_sp_s" in bf16 and "layer_sp_s" in fp8:
        point["speedup_sp"] = bf16["layer_sp_s"] / fp8["layer_sp_s"]
    return point


def apply_profile(calibration: dict, profile: dict, source: str) -> dict:
    """`calibration` (this script's JSON) with its points as sequence parallel runs the shard
    (`sequence_parallel`), their rest from `profile`'s rows (another run of this script with
    `--profile`, at tp 1 and at least one wider tp; FP8 too for FP8's points), and `profile`'s
    FP8 points at shard sizes `calibration` lacks."""
    out = json.loads(json.dumps(calibration))
    rows = profile["rows"] if "rows" in profile else profile["points"]
    sequence_parallel(out["points"], rows)
    bf16 = {p["tp"]: p for p in out["points"]}
    fp8 = {p["tp"]: p for p in out.get("fp8_points", [])}
    for p in profile.get("fp8_points", []):
        fp8.setdefault(p["tp"], dict(p))
    timed = [  # FP8's layer: the bf16 point's time over its speed-up.
        dict(tp=tp, variant="fp8", layer_s=bf16[tp]["layer_s"] / p["speedup"])
        for tp, p in fp8.items()
        if tp in bf16
    ]
    sequence_parallel(timed, rows)
    for row in timed:
        if "layer_sp_s" in row and "layer_sp_s" in bf16[row["tp"]]:
            fp8[row["tp"]]["speedup_sp"] = bf16[row["tp"]]["layer_sp_s"] / row["layer_sp_s"]
    out["fp8_points"] = [fp8[tp] for tp in sorted(fp8)]
    out["sequence_parallel_from"] = dict(
        source=source, **{k: profile.get(k) for k in ("command", "commit", "device", "jax", "date")}
    )
    return out


def points_from_records(gpu: str, root: pathlib.Path = ROOT) -> dict:
    """The default calibration (cost_model.DEFAULT_POINTS) derived from the one-GPU step
    records on file: llama_1b and fp8_8b_8layers's bf16 run (their FLOPs with what their remat
    recomputes, over the step less the modelled optimizer update), and FP8's speed-up."""
    from angel_jax.config import load_config
    from angel_jax.plan import model_shape, param_count
    from angel_jax.planning import cost_model
    from angel_jax.remat import REMATS

    records = {
        "llama_1b": ("configs/llama_1b.py", []),
        "fp8_8b_8layers": ("configs/llama3_8b.py", ["--config.model.num_layers=8"]),
    }
    points = []
    for name, (config_path, overrides) in records.items():
        record = json.loads((root / "experiments" / "records" / gpu / f"{name}.json").read_text())
        r = record["results"][0]
        shape = model_shape(load_config(str(root / config_path), overrides).model)
        mm, att = 2 * shape.layer_matmul_params(), shape.layer_attention_flops(r["seq"])
        share_att, share_mm = REMATS[r["remat"]].recompute
        per_token = shape.flops_per_token(r["seq"]) + shape.num_layers * (
            share_att * att + share_mm * mm
        )
        update = cost_model.update_s(param_count(shape), cost_model.GPUS[gpu], False)
        eff = cost_model.record_efficiency(
            r["step_s"], r["batch"] * r["seq"], per_token, update, cost_model.GPUS[gpu].peak_tflops
        )
        points.append(
            dict(record=name, layer_params_per_device=shape.layer_matmul_params(), efficiency=eff)
        )
    return dict(gpu=gpu, points=points, fp8_speedup=record["metrics"]["x bf16"])


def schedule_points(config_path: str, tps: list[int], seq_len: int, gpu: str) -> list[dict]:
    """How much of the tensor collectives a layer loop's compiled schedule leaves exposed at
    each tensor size (planning/schedule.py): the config's model with 2 layers on a host of 8
    GPUs (data x tensor, ZeRO-1, `dots_attention`, a sequence a device), compiled for `gpu`'s
    target here (JAX's CUDA plugin; no GPU needed)."""
    from angel_jax import plan

    points = []
    for tp in tps:
        args = argparse.Namespace(
            config=config_path,
            overrides=["--config.model.num_layers=2"],
            seq_len=seq_len,
            global_batch_tokens=seq_len * 8 // tp,
            gpu=gpu,
            gpus=8,
            hosts=1,
        )
        layout = plan.Layout(8 // tp, tp, 1, 1, 1, "dots_attention", 1)
        got = plan.compile_layout(plan.make_problem(args), layout, hosts=1)
        points.append(dict(tensor=tp, exposed=got["tensor_exposed"], layout=layout.name()))
        print(json.dumps(points[-1]), flush=True)
    return points


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/llama3_70b.py")
    parser.add_argument("--gpu", default="h100", help="the peak and the records' folder")
    parser.add_argument("--tp", default="1,2,4,8", help="tensor-parallel sizes to time")
    parser.add_argument("--fp8-tp", default="4", help="of those, the sizes also timed in FP8")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--profile", action="store_true", help="time each layer's kernels by kind")
    parser.add_argument("--out", help="default: experiments/calibration/<gpu>.json")
    parser.add_argument("--from-records", metavar="GPU", help="print the default calibration")
    parser.add_argument(
        "--profile-from",
        metavar="JSON",
        help="instead of timing, correct --out's points for sequence parallel from the kernel "
        "profile of another run of this script (--profile at tp 1 and a wider tp)",
    )
    parser.add_argument(
        "--schedule-tp",
        metavar="SIZES",
        help="instead of timing, compile the layer loop for these tensor sizes (on a CPU with "
        "JAX's CUDA plugin) and write the exposed share of their collectives into --out",
    )
    args = parser.parse_args()
    if args.from_records:
        print(json.dumps(points_from_records(args.from_records), indent=1))
        return 0
    sizes = lambda text: [int(t) for t in text.split(",")]
    sys.path.insert(0, str(ROOT / "experiments"))
    from bench import commit

    path = pathlib.Path(args.out or ROOT / "experiments" / "calibration" / f"{args.gpu}.json")
    if args.profile_from:
        profile = json.loads(pathlib.Path(args.profile_from).read_text())
        out = apply_profile(json.loads(path.read_text()), profile, args.profile_from)
        path.write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {path}")
        return 0
    if args.schedule_tp:
        out = json.loads(path.read_text()) if path.is_file() else dict(gpu=args.gpu, points=[])
        out["tensor_exposed_points"] = schedule_points(
            args.config, sizes(args.schedule_tp), args.seq_len, args.gpu
        )
        out["tensor_exposed_command"] = "python " + " ".join(sys.argv)
        out["tensor_exposed_commit"] = commit()
        path.write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {path}")
        return 0
    out = measure(
        args.config,
        sizes(args.tp),
        sizes(args.fp8_tp),
        args.seq_len,
        args.reps,
        args.gpu,
        args.profile,
    )
    out.update(command="python " + " ".join(sys.argv), commit=commit())
    if path.is_file():  # The schedule's points are another command's (--schedule-tp).
        kept = json.loads(path.read_text())
        out.update({k: v for k, v in kept.items() if k.startswith("tensor_exposed")})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
