"""Training metrics: throughput and MFU, written to metrics.jsonl, TensorBoard and the terminal."""

import json
import math
import pathlib
import sys

import jax
import numpy as np

# Dense bf16 peak TFLOP/s per device, by `device_kind` substring.
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "H800": 989.0, "A100": 312.0, "B200": 2250.0}


def peak_tflops(configured: float) -> float | None:
    """Configured peak, else the device kind's; None where unknown (MFU is then not reported)."""
    if configured > 0:
        return configured
    kind = jax.devices()[0].device_kind
    return next((v for k, v in PEAK_TFLOPS.items() if k in kind), None)


def json_line(record: dict) -> str:
    """`record` as one line of strict JSON: NaN and infinities (a diverging loss) as the
    strings "nan", "inf" and "-inf", which every JSON parser reads, not as bare NaN."""

    def safe(value):
        if isinstance(value, float) and not math.isfinite(value):
            return str(value)
        if isinstance(value, dict):
            return {k: safe(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [safe(v) for v in value]
        return value

    return json.dumps(safe(record), allow_nan=False)


# A mixture of experts' per-layer counts (losses.TrainingLoss), which the gradient code
# averages over microbatches like every metric.
MOE_COUNTS = ("moe_tokens_per_expert", "moe_dropped_tokens")


def host_metrics(device_metrics: dict, microbatches: int) -> dict:
    """A step's metrics as Python numbers (ints stay ints: `skipped`). A mixture of experts'
    per-layer arrays (`moe_*`) become lists, one entry a layer: the counts summed over the
    step's microbatches, and each layer's load imbalance, max over mean tokens per expert."""
    out = {}
    for name, value in jax.device_get(device_metrics).items():
        value = np.asarray(value)
        if name in MOE_COUNTS:
            out[name] = np.rint(value * microbatches).astype(np.int64).tolist()
        elif name.startswith("moe_"):
            out[name] = value.astype(float).tolist()
        else:
            out[name] = value.item()
    if "moe_tokens_per_expert" in out:
        load = np.asarray(out["moe_tokens_per_expert"], np.float64)
        out["moe_load_max_over_mean"] = (load.max(-1) / np.maximum(load.mean(-1), 1e-9)).tolist()
    return out


class MetricsWriter:
    def __init__(self, workdir: str, tensorboard: bool = True):
        self.dir = pathlib.Path(workdir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.main = jax.process_index() == 0
        self._jsonl = open(self.dir / "metrics.jsonl", "a") if self.main else None
        self._tb = None
        if tensorboard and self.main:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(str(self.dir / "tensorboard"))

    def write(self, step: int, metrics: dict) -> None:
        if not self.main:
            return
        self._jsonl.write(json_line({"step": step, **metrics}) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            for name, value in metrics.items():
                if isinstance(value, int | float) and not isinstance(value, bool):
                    self._tb.add_scalar(name, value, step)
                elif isinstance(value, list):  # Per layer (host_metrics).
                    self._per_layer(name, value, step)
            self._tb.flush()

    def _per_layer(self, name: str, values: list, step: int) -> None:
        """A scalar a layer under `name/layer_NN`; a vector a layer (tokens per expert) as a
        histogram of its entries."""
        for i, value in enumerate(values):
            tag = f"{name}/layer_{i:02d}"
            if isinstance(value, list):
                self._tb.add_histogram(tag, np.asarray(value), step)
            else:
                self._tb.add_scalar(tag, value, step)

    def close(self) -> None:
        if self._jsonl:
            self._jsonl.close()
        if self._tb:
            self._tb.close()


def progress_line(step: int, last_step: int, m: dict) -> str:
    mfu = "n/a" if m.get("mfu") is None else f"{100 * m['mfu']:.1f}%"
    eta = m["step_time_s"] * (last_step - step)
    return (
        f"step {step:>6}/{last_step}  loss {m['loss']:.4f}  {m['tokens_per_s']:,.0f} tok/s  "
        f"MFU {mfu}  {m['step_time_s'] * 1e3:.0f} ms/step  ETA {_hms(eta)}"
    )


def _hms(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def say(text: str) -> None:
    if jax.process_index() == 0:
        print(text, file=sys.stderr, flush=True)
