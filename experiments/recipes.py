"""The headline records as recipes that `bench.py` re-runs: one experiment script's command, the
GPU kinds it fits with its expected time on each, and how its headline figures come out of the
script's results.

A figure named in `compare` is checked against the current record at each re-run (5%); a goal is
a range the figure must stay in on that GPU kind. Peers run in the same job as ours, so the
ratios to them are the figures compared: machines are noisy, ratios in one job less so.
"""

import dataclasses
from collections.abc import Callable

KINDS = ("h100", "h200")
Figures = dict[str, float | str]


class Failed(Exception):
    """A run whose results lack a headline figure: what its script recorded instead."""


def row(results: list[dict], system: str) -> dict:
    """The result named `system` that ran; Failed with its error if it did not."""
    for r in results:
        if r.get("system") == system:
            if "error" in r or "tokens_per_s" not in r:
                raise Failed(f"{system}: {r.get('error', 'no tokens/s recorded')}")
            return r
    raise Failed(f"{system}: not in the results")


def f8_calls(results: list[dict], system: str) -> int:
    """FP8 cuBLAS GEMMs in the compiled step: an FP8 variant with none ran bf16 kernels."""
    calls = row(results, system).get("kernels", {}).get("__cublas$lt$matmul$f8", 0)
    if not calls:
        raise Failed(f"{system}: no FP8 GEMM in the compiled step (it ran bf16 kernels)")
    return calls


def against(results: list[dict], ours: str, base: str, ours_as: str, base_as: str) -> Figures:
    """tokens/s and MFU of the result `ours`, tokens/s of `base`, and their ratio, the figures
    named by `ours_as` and `base_as`."""
    a, b = row(results, ours), row(results, base)
    return {
        f"{ours_as} tokens/s": a["tokens_per_s"],
        f"{ours_as} MFU": a["mfu"],
        f"{base_as} tokens/s": b["tokens_per_s"],
        f"x {base_as}": a["tokens_per_s"] / b["tokens_per_s"],
    }


@dataclasses.dataclass(frozen=True)
class Recipe:
    name: str
    what: str  # The record, in a line.
    script: str  # From the repository's root.
    args: tuple[str, ...]  # "{baselines}" stands for the peers' directory.
    seconds: dict[str, int]  # Expected wall seconds of the whole run on each kind it fits.
    metrics: Callable[[list[dict]], Figures]  # The headline figures from the script's results.
    compare: tuple[str, ...]  # Figures a re-run keeps within 5% of the record's.
    goals: dict[str, dict[str, tuple[float | None, float | None]]] = dataclasses.field(
        default_factory=dict
    )  # Per kind: figure -> (least, most), None for no bound.
    kind_args: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    unfit: dict[str, str] = dataclasses.field(default_factory=dict)  # Kind -> why it can't run.

    def command(self, kind: str, out: str, baselines: str) -> list[str]:
        """The script's arguments on `kind`, results to `out` (config overrides, after "--",
        last)."""
        args = [
            a.replace("{baselines}", baselines) for a in (*self.args, *self.kind_args.get(kind, ()))
        ]
        flags = [a for a in args if not a.startswith("--config.")]
        overrides = [a for a in args if a.startswith("--config.")]
        flags = [a for a in flags if a != "--"]
        return [self.script, *flags, "--out", out, *(["--", *overrides] if overrides else [])]


def _dense(results):
    return against(results, "angel-jax", "plain-jax", "ours", "plain JAX")


def _fp8(results):
    figures = against(results, "fp8 matmul + lm head", "bf16", "FP8", "bf16")
    figures["FP8 GEMMs in the step"] = f8_calls(results, "fp8 matmul + lm head")
    return figures


MOE, TWIN = "moe_1b dropless (auto) expert=1", "dense twin (ffn 11264) data=1"


def _moe(results):
    moe = row(results, MOE)
    figures = against(results, MOE, TWIN, "MoE", "dense twin")
    figures["batch"] = moe["batch"]
    figures["peak GiB"] = moe["peak_gib"]
    figures["planned GiB"] = moe["planned_device_gib"]
    figures["planned / peak"] = moe["planned_device_gib"] / moe["peak_gib"]
    figures["Mosaic GPU grouped GEMMs"] = moe.get("kernels", {}).get("mosaic_gpu_v2", 0)
    return figures


def _long(length: int):
    def figures(results):
        runs = {r["asked_remat"]: r for r in results if r.get("seq_len") == length}
        if "auto" not in runs or "tokens_per_s" not in runs["auto"]:
            raise Failed(f"{length} tokens, remat auto: {runs.get('auto', {}).get('error')}")
        auto = runs["auto"]
        out: Figures = {
            "tokens/s": auto["tokens_per_s"],
            "MFU": auto["mfu"],
            "remat": auto["remat"],
            "layer inputs": "host" if auto.get("layer_inputs_on_host") else "device",
            "peak GiB": auto["peak_gib"],
        }
        if "tokens_per_s" in runs.get("full", {}):
            out["x remat full"] = auto["tokens_per_s"] / runs["full"]["tokens_per_s"]
        return out

    return figures


V8_1M = "llama3_8b optimizer, 128 x 8192 in 64 microbatches, fp8 matmul + lm head, device update"


def _offload_8b_1m(results):
    r = row(results, V8_1M)
    return {
        "tokens/s": r["tokens_per_s"],
        "MFU": r["mfu"],
        "peak GiB": r["peak_gib"],
        "update GB each way": r["update_gb_each_way"],
        "FP8 GEMMs in the step": f8_calls(results, V8_1M),
    }


V8 = "llama3_8b auto, 16 x 8192 in 16 microbatches"


def _offload_8b_128k(results):
    delayed, exact = (
        row(results, f"{V8}, delayed, device update"),
        row(results, f"{V8}, device update"),
    )
    return {
        "delayed tokens/s": delayed["tokens_per_s"],
        "delayed MFU": delayed["mfu"],
        "exact tokens/s": exact["tokens_per_s"],
        "delayed x exact": delayed["tokens_per_s"] / exact["tokens_per_s"],
        "remat": delayed["remat"],
    }


_NAMES = {"adamw": "AdamW", "adafactor": "Adafactor"}


def _capacity_recipe(optimizer: str, args: tuple[str, ...]) -> Recipe:
    """The deepest model one GPU trains with `optimizer`, its optimizer state on the SSD tier
    (compressed) past the host's 96 GiB of pinned memory."""

    def figures(results):
        r = next((r for r in results if r.get("optimizer") == optimizer), {})
        if not r.get("finite"):
            raise Failed(f"{optimizer}: {r.get('error', 'non-finite loss')}")
        return {
            "parameters (B)": r["params"] / 1e9,
            "layers": r["layers"],
            "bytes a parameter": r["bytes_per_param"],
            "peak device GiB": r["peak_device_gib"],
            "peak host RSS GiB": r["peak_host_rss_gib"],
        }

    common = ("--only", f"{optimizer}/auto", "--host-gib", "96", "--ssd-dir", "/tmp/ssd")
    return Recipe(
        f"capacity_{optimizer}",
        f"the largest model one GPU trains with {_NAMES[optimizer]} (host memory and SSD tiers)",
        "experiments/capacity.py",
        (*common, "--ssd-compress", *args),
        {"h200": 540},
        figures,
        ("parameters (B)",),
        # The search plans under the records' 96 GiB pool; each child takes its plan's advice.
        env={"MALLOC_MMAP_THRESHOLD_": "131072", "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB": "96"},
        unfit={"h100": "sized for the H200's device memory; not planned for 80 GB yet"},
    )


PEER = "deepspeed zero-2, optimizer on the CPU (peer)"
V1 = "llama_1b optimizer, device update, 8 in flight"
V4 = "llama_1b/8x2048 in 4 optimizer, delayed, device update"


def _offload_llama_1b(results):
    exact, delayed, peer = row(results, V1), row(results, V4), row(results, PEER)
    return {
        "exact tokens/s": exact["tokens_per_s"],
        "delayed tokens/s": delayed["tokens_per_s"],
        "DeepSpeed tokens/s": peer["tokens_per_s"],
        "exact x DeepSpeed": exact["tokens_per_s"] / peer["tokens_per_s"],
        "delayed x DeepSpeed": delayed["tokens_per_s"] / peer["tokens_per_s"],
    }


_NO_8B_1M = "its step peaks at 102 GiB of device memory (FP8, 64 microbatches of 2 x 8192)"
RECIPES = [
    Recipe(
        "llama_1b",
        "dense `llama_1b`, 8 x 2048, against plain JAX (same job)",
        "experiments/throughput.py",
        ("--only", "angel-jax,plain-jax", "--baselines", "{baselines}", "--steps", "10"),
        {"h100": 150, "h200": 150},
        _dense,
        ("x plain JAX",),
        goals={k: {"x plain JAX": (1.10, None)} for k in KINDS},
    ),
    Recipe(
        "fp8_llama_1b",
        "`llama_1b` with FP8 matmuls + LM head against bf16 (same job)",
        "experiments/fp8_throughput.py",
        ("--only", "bf16,fp8 matmul + lm head"),
        {"h100": 180, "h200": 180},
        _fp8,
        ("x bf16",),
    ),
    Recipe(
        "fp8_8b_8layers",
        "`llama3_8b` widths, 8 layers, 2 x 8192, FP8 matmuls + LM head against bf16 (same job)",
        "experiments/fp8_throughput.py",
        (
            "--config",
            "configs/llama3_8b.py",
            "--only",
            "bf16,fp8 matmul + lm head",
            "--config.model.num_layers=8",
            "--config.zero_stage=1",
            "--config.train.microbatches=1",
            "--config.train.batch_size=2",
            "--config.model.remat=dots_no_batch",
        ),
        {"h100": 200, "h200": 180},
        _fp8,
        ("x bf16",),
        goals={"h100": {"x bf16": (1.30, None)}, "h200": {"x bf16": (1.35, None)}},
    ),
    Recipe(
        "moe_1b_dropless",
        "`moe_1b`, dropless router, against its dense twin of the same active FLOPs (same job)",
        "experiments/moe_throughput.py",
        ("--routers", "dropless"),
        {"h100": 200, "h200": 200},
        _moe,
        ("x dense twin",),
        # The planner's device estimate within 10% of what the step used.
        goals={k: {"planned / peak": (0.9, 1.1)} for k in KINDS},
        # The largest batches that fit, as planned and compiled for each GPU.
        kind_args={"h100": ("--batch-per-device", "6"), "h200": ("--batch-per-device", "8")},
    ),
    Recipe(
        "long_context_262k",
        "`llama_1b` at 262,144 tokens, remat `auto` against `full` (same job)",
        "experiments/long_context.py",
        # One warm-up step each: a first step also grows the pinned host pool (2-5 GB/s
        # while it grows), which would charge `auto`'s host-held layer inputs for it.
        ("--start", "262144", "--max", "262144", "--remats", "auto,full", "--warmup", "1"),
        {"h100": 420, "h200": 380},
        _long(262144),
        ("tokens/s",),
    ),
    Recipe(
        "long_context_524k",
        "`llama_1b` at 524,288 tokens, remat `auto`, one step after its compile",
        "experiments/long_context.py",
        ("--start", "524288", "--max", "524288", "--remats", "auto", "--warmup", "0"),
        {"h200": 400},
        _long(524288),
        ("tokens/s",),
        unfit={"h100": "its step peaks at 107 GiB of device memory"},
    ),
    Recipe(
        "offload_8b_1m",
        "`llama3_8b`, AdamW in host memory, 128 x 8192 tokens a step, FP8 matmuls + LM head",
        "experiments/offload_throughput.py",
        ("--warmup", "1", "--only", f"={V8_1M}"),
        {"h200": 360},
        _offload_8b_1m,
        ("tokens/s",),
        goals={"h200": {"tokens/s": (12500, None)}},
        # The pinned-host pool cap the plan prints for this run (tiers.pool_advice).
        env={"XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB": "93"},
        unfit={"h100": _NO_8B_1M},
    ),
    Recipe(
        "offload_8b_128k",
        "`llama3_8b`, 16 x 8192 tokens a step, optimizer offloaded: delayed update against exact",
        "experiments/offload_throughput.py",
        (
            "--warmup",
            "3",
            "--steps",
            "2",
            "--only",
            f"={V8}, delayed, device update;={V8}, device update",
        ),
        {"h200": 520},
        _offload_8b_128k,
        ("delayed x exact",),
        unfit={"h100": "its step peaks at 126 GiB of device memory"},
    ),
    _capacity_recipe("adamw", ("--steps", "2", "--ssd-gib", "61", "--ffn", "13952")),
    _capacity_recipe("adafactor", ("--ssd-gib", "55")),
    Recipe(
        "offload_llama_1b",
        "`llama_1b` 8 x 2048, optimizer in host memory, against DeepSpeed ZeRO-Offload (same job)",
        "experiments/offload_throughput.py",
        ("--only", f"={V1};={V4}", "--baselines", "{baselines}"),
        {"h100": 330, "h200": 330},
        _offload_llama_1b,
        ("exact x DeepSpeed", "delayed x DeepSpeed"),
        env={"XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB": "60"},
    ),
]
