"""The run planner (angel_jax/plan.py) against published large runs: for each, the cost model's
prediction for the publisher's layout as their system runs it (the model's check: the goal is
within 15% of the published figure), for the same layout as our trainer would run it (our
pipeline schedules, our memory), and for our best layout.

    python experiments/plan_published.py [--only NAME ...] [--compile-gpus 128] [--out FILE]

Published figures (tokens/s/GPU; MFU as they count it: 6 x params + non-causal attention,
12 x layers x seq x d per token, over 989 TFLOP/s bf16):
- NeMo Llama 3 70B, 64 H100, bf16, seq 8192, GBS 128: 1,121 tok/s/GPU, 54.5% (figure as issue
  62 gives it; the layout TP4 PP4 CP2 VP5 DP2, MBS 1, from NVIDIA's DGXC benchmarking recipe
  "NeMo Llama 3.1 Pretrain 25.04.01"). Megatron's TP overlap and no activation recompute assumed.
- MaxText Llama 3 70B, 128 H100, bf16, seq 8192, GBS 256: 1,052 tok/s/GPU, 51.2% (DGXC
  benchmarking recipe: FSDP 8 in a host x 16 across, per-device batch 2, no accumulation). Its
  remat policy is not given: the fastest of ours that fits.
- Llama 3 405B (arXiv 2407.21783 Table 4): 8,192 H100, TP8 CP1 PP16 DP64, seq 8192, 16M tokens
  a batch: 430 TFLOP/s/GPU (43%); 16,384 H100, DP128: 400 (41%); 16,384 H100, TP8 CP16 PP16
  DP8 at seq 131,072: 380 (38%). tok/s/GPU from their TFLOP/s at the convention above.
  Interleaved 1F1B with 4 virtual stages and no recompute assumed (not given).
- torchtitan Llama 3.1 70B, 256 H100, FP8, seq 8192: 829 tok/s/GPU (FSDP 32 x TP 8), 876 with
  async TP (arXiv 2410.06511; torchtitan's benchmarks/llama3_h100_202412_torchtitan.md: local
  batch 16 sequences per FSDP rank group, full activation checkpointing). The same layout in
  bf16: 597.3 tok/s/GPU with vanilla TP (FP8 tensorwise 809.8 there;
  benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md). Its H100s are 96 GB HBM2e at 500 W.
"""

import argparse
import dataclasses
import itertools
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import commit  # noqa: E402
from throughput import machine  # noqa: E402

from angel_jax import plan  # noqa: E402
from angel_jax.config import ConfigError, load_config  # noqa: E402
from angel_jax.plan import Layout, Problem  # noqa: E402
from angel_jax.planning import cost_model  # noqa: E402

L70, L405 = "configs/llama3_70b.py", "configs/llama3_405b.py"
GPUS_A_HOST = 8


@dataclasses.dataclass(frozen=True)
class Published:
    name: str
    config: str
    gpus: int
    seq_len: int
    batch: int  # Sequences a step.
    layout: Layout  # Theirs, in our terms (remat "" : the fastest of ours that fits).
    system: cost_model.System
    tokens_per_s: float  # Published, per GPU.
    mfu: float  # Published, their convention.
    fp8: bool = False


RUNS = [
    Published(
        "NeMo 70B",
        L70,
        64,
        8192,
        128,
        Layout(2, 4, 4, 2, 1, "dots_attention", 64, "1f1b", 5),
        cost_model.MEGATRON,
        1121,
        0.545,
    ),
    Published(
        "MaxText 70B",
        L70,
        128,
        8192,
        256,
        Layout(128, 1, 1, 1, 3, "", 1),
        cost_model.OURS,
        1052,
        0.512,
    ),
    Published(
        "Llama 3 405B, 8k GPUs",
        L405,
        8192,
        8192,
        2048,
        Layout(64, 8, 16, 1, 1, "dots_attention", 32, "1f1b", 4),
        cost_model.MEGATRON,
        0,
        0.43,
    ),
    Published(
        "Llama 3 405B, 16k GPUs",
        L405,
        16384,
        8192,
        2048,
        Layout(128, 8, 16, 1, 1, "dots_attention", 16, "1f1b", 4),
        cost_model.MEGATRON,
        0,
        0.41,
    ),
    Published(
        "Llama 3 405B, 131k seq",
        L405,
        16384,
        131072,
        128,
        Layout(8, 8, 16, 16, 1, "dots_attention", 16, "1f1b", 4),
        cost_model.MEGATRON,
        0,
        0.38,
    ),
    # torchtitan's FSDP 32 x TP 8 on 256 GPUs, 16 sequences a step per FSDP rank group.
    *(
        Published(
            f"torchtitan 70B {name}",
            L70,
            256,
            8192,
            512,
            Layout(32, 8, 1, 1, 3, "full", 1),
            cost_model.TORCHTITAN,
            tokens_per_s,
            0.0,
            fp8=name == "FP8",
        )
        for name, tokens_per_s in (("bf16", 597.3), ("FP8", 829))
    ),
]
LLAMA3_TFLOPS = {
    "Llama 3 405B, 8k GPUs": 430,
    "Llama 3 405B, 16k GPUs": 400,
    "Llama 3 405B, 131k seq": 380,
}


def their_flops(shape, seq_len: int) -> float:
    """Training FLOPs a token as the publishers count them: non-causal attention."""
    return shape.flops_per_token(seq_len) + 3 * shape.num_layers * shape.layer_attention_flops(
        seq_len
    )


def problem_for(run: Published, gpu: str = "h100") -> Problem:
    overrides = [f"--config.train.seq_len={run.seq_len}", f"--config.train.batch_size={run.batch}"]
    if run.fp8:
        overrides.append("--config.fp8.matmul=true")
    config = load_config(str(ROOT / run.config), overrides)
    return Problem(
        config,
        run.gpus,
        cost_model.GPUS[gpu],
        run.seq_len,
        run.batch,
        cost_model.load_calibration(gpu),
    )


def compare(run: Published, search: bool = True, compile_best: bool = False) -> dict:
    """The row of `run`: the model on their layout, ours on it and (with `search`) our best,
    with `compile_best` compiled for the run's whole topology (plan.compile_layout)."""
    problem = problem_for(run)
    shape = plan.model_shape(problem.config.model)
    theirs = run.layout
    if not theirs.remat:  # The fastest of our remat policies that fits their mesh.
        options = [
            plan.evaluate(problem, shape, dataclasses.replace(theirs, remat=r))
            for r in plan.AUTO_REMATS
        ]
        fitting = [c for c in options if c.fits] or options
        theirs = min(fitting, key=lambda c: c.breakdown.total_s).layout
    published_tps = run.tokens_per_s or LLAMA3_TFLOPS[run.name] * 1e12 / their_flops(
        shape, run.seq_len
    )
    # Meta does not say how it counts attention's FLOPs: with causal attention counted half
    # (our convention), its TFLOP/s are more tokens/s, 4% at 8k, 40% at 131k.
    causal_tps = run.tokens_per_s or LLAMA3_TFLOPS[run.name] * 1e12 / shape.flops_per_token(
        run.seq_len
    )
    model = plan.evaluate(problem, shape, theirs, run.system, with_memory=False)
    try:  # Our schedules and memory: the fastest remat policy and ZeRO stage that fit.
        remats = plan.STAGE_REMATS if theirs.pipeline > 1 else plan.AUTO_REMATS
        options = [
            plan.evaluate(problem, shape, dataclasses.replace(theirs, remat=r, zero=z))
            for r, z in itertools.product(remats, range(4))
        ]
        ours = min([c for c in options if c.fits] or options, key=lambda c: c.breakdown.total_s)
    except ConfigError as e:  # A mesh our trainer refuses.
        ours = None
        refused = str(e).split(": ", 1)[-1]
    row = dict(
        run=run.name,
        gpus=run.gpus,
        seq_len=run.seq_len,
        layout=theirs.name(),
        published_tokens_per_s=published_tps,
        published_mfu=run.mfu or published_tps * their_flops(shape, run.seq_len) / 989e12,
        model_tokens_per_s=model.tokens_per_s,
        model_mfu=model.tokens_per_s * their_flops(shape, run.seq_len) / 989e12,
        model_error=model.tokens_per_s / published_tps - 1,
        published_tokens_per_s_causal=causal_tps,
        model_error_causal=model.tokens_per_s / causal_tps - 1,
        model_breakdown=dataclasses.asdict(model.breakdown),
    )
    if ours is None:
        row.update(ours_on_their_layout_refused=refused)
    else:
        row.update(
            ours_on_their_layout=ours.layout.name(),
            ours_on_their_layout_tokens_per_s=ours.tokens_per_s,
            ours_on_their_layout_gib=ours.memory_gib,
            ours_on_their_layout_fits=ours.fits,
        )
    fits, over = plan.search(problem) if search else ([], [])
    if fits:
        best = fits[0]
        row.update(
            our_best=best.layout.name(),
            our_best_tokens_per_s=best.tokens_per_s,
            our_best_mfu=best.tokens_per_s * their_flops(shape, run.seq_len) / 989e12,
            our_best_gib=best.memory_gib,
        )
        if compile_best:
            compiled = plan.compile_layout(problem, best.layout, hosts=run.gpus // GPUS_A_HOST)
            again = plan.with_compiled_schedule(
                problem, shape, best.layout, compiled["tensor_exposed"]
            )
            row.update(
                our_best_tokens_per_s_compiled_schedule=again.tokens_per_s,
                our_best_compiled_gib=compiled["compiled_peak_gib"],
                our_best_usable_gib=compiled["usable_gib"],
                our_best_compiled=compiled,
            )
    elif over:  # The layout nearest to fitting, to say how far off the trainer is.
        row.update(our_smallest=over[0].layout.name(), our_smallest_gib=over[0].memory_gib)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the rows as JSON here")
    parser.add_argument("--only", action="append", help="a run's name (repeat for more)")
    parser.add_argument(
        "--compile-gpus",
        type=int,
        default=0,
        metavar="N",
        help="compile our best layout for the whole topology of each run on at most N GPUs, "
        "on this machine (JAX's CUDA plugin, no GPU needed; about a minute at 64-128 GPUs)",
    )
    args = parser.parse_args()
    only = args.only or [r.name for r in RUNS]
    rows = [compare(r, compile_best=r.gpus <= args.compile_gpus) for r in RUNS if r.name in only]
    head = (
        "run",
        "published tok/s/GPU (MFU)",
        "model, their layout",
        "error",
        "ours on their layout",
        "our best layout",
    )
    print(" | ".join(head))
    for r in rows:
        if "our_best" in r:
            best = f"{r['our_best_tokens_per_s']:,.0f} ({r['our_best_mfu']:.1%}) {r['our_best']}"
            if "our_best_compiled_gib" in r:
                best += (
                    f", {r['our_best_tokens_per_s_compiled_schedule']:,.0f} with its compiled "
                    f"schedule's overlap, compiled {r['our_best_compiled_gib']:.1f} GiB of "
                    f"{r['our_best_usable_gib']:.1f} usable ({r['our_best_gib']:.1f} predicted)"
                )
        elif "our_smallest" in r:
            best = f"none fits (smallest {r['our_smallest_gib']:.0f} GiB: {r['our_smallest']})"
        else:
            best = "no layout of ours splits this batch over these GPUs"

        if "ours_on_their_layout_refused" in r:
            theirs = "refused: " + r["ours_on_their_layout_refused"]
        else:
            fits = "fits" if r["ours_on_their_layout_fits"] else "over memory"
            theirs = (
                f"{r['ours_on_their_layout_tokens_per_s']:,.0f} "
                f"({r['ours_on_their_layout_gib']:.0f} GiB, {fits}, "
                f"z{r['ours_on_their_layout'].split(' z')[1].split()[0]} "
                f"{r['ours_on_their_layout'].split()[-1]})"
            )
        print(
            " | ".join(
                (
                    f"{r['run']} ({r['gpus']} GPUs, {r['layout']})",
                    f"{r['published_tokens_per_s']:,.0f} ({r['published_mfu']:.1%})",
                    f"{r['model_tokens_per_s']:,.0f} ({r['model_mfu']:.1%})",
                    f"{r['model_error']:+.0%}"
                    + (
                        f" ({r['model_error_causal']:+.0%} with causal attention counted half)"
                        if r["run"] in LLAMA3_TFLOPS
                        else ""
                    ),
                    theirs,
                    best,
                )
            )
        )
    if args.out:
        record = dict(
            command="python experiments/plan_published.py " + " ".join(sys.argv[1:]),
            commit=commit(),
            machine=machine(),
            results=rows,
        )
        pathlib.Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
