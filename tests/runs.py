"""Helpers for tests that run the launcher (or the supervisor) in subprocesses."""

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]

# A run small enough to start in a few seconds: one layer, synthetic data, a checkpoint every
# other step. The planner's device budget is given, so no process asks another's device.
SMALL = [
    "--config",
    "configs/tiny.py",
    "--config.train.steps=8",
    "--config.train.batch_size=8",
    "--config.train.seq_len=32",
    "--config.train.log_every_steps=1",
    "--config.train.tensorboard=false",
    "--config.model.num_layers=1",
    "--config.data.synthetic=true",
    "--config.checkpoint.every_steps=2",
    "--config.offload.device_gib=1",
]


def env(devices: int, faults: str = "") -> dict[str, str]:
    """The environment of a launcher subprocess: `devices` CPU devices, the faults to inject,
    and the test run's compilation cache (tests/conftest.py), so restarts and repeated runs
    of one program compile it once."""
    e = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    # Unoptimised CPU code compiles in two thirds of the time; these runs are a few steps.
    e["XLA_FLAGS"] = (
        f"--xla_force_host_platform_device_count={devices} --xla_backend_optimization_level=0"
    )
    e.pop("ANGEL_FAULTS", None)
    if faults:
        e["ANGEL_FAULTS"] = faults
    return e


def start(module: str, workdir, args, environ) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", module, "--workdir", str(workdir), *args],
        cwd=ROOT,
        env=environ,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def run(module: str, workdir, args, environ, timeout=300) -> subprocess.CompletedProcess:
    proc = start(module, workdir, args, environ)
    out, err = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def losses(workdir) -> dict[int, float]:
    """Loss per step; a step logged again (after a restart or a rollback) keeps its last line.
    A NaN loss is logged as the string "nan" (strict JSON), so equal runs compare equal."""
    out = {}
    for line in (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        out[record["step"]] = record["loss"]
    return out


def jsonl(path) -> list[dict]:
    path = pathlib.Path(path)
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
