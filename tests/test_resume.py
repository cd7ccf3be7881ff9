"""A run killed with SIGKILL at any moment and restarted continues to the same losses, bitwise."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

STEPS = 12
ARGS = [
    "--config",
    "configs/tiny.py",
    f"--config.train.steps={STEPS}",
    "--config.train.log_every_steps=1",
    "--config.train.batch_size=8",
    "--config.train.seq_len=32",
    "--config.model.num_layers=1",
    "--config.checkpoint.every_steps=3",
    "--config.mesh.data=4",
    "--config.mesh.tensor=2",
    "--config.zero_stage=3",
]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def env():
    e = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    e["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    return e


def launch(workdir, *overrides):
    return subprocess.Popen(
        [sys.executable, "-m", "angel_jax.launch", "--workdir", str(workdir), *ARGS, *overrides],
        cwd=ROOT,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def losses(workdir) -> dict[int, float]:
    """Loss per step; a step logged again after a restart overwrites the earlier line."""
    out = {}
    path = workdir / "metrics.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                record = json.loads(line)
                out[record["step"]] = record["loss"]
    return out


def committed(workdir) -> bool:
    ckpts = workdir / "checkpoints"
    return ckpts.exists() and any(p.name.isdigit() for p in ckpts.iterdir())


def finish(proc) -> str:
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    return err


@pytest.fixture(scope="module")
def expected(tmp_path_factory):
    """Losses of an uninterrupted run."""
    reference = tmp_path_factory.mktemp("reference")
    finish(launch(reference))
    result = losses(reference)
    assert sorted(result) == list(range(1, STEPS + 1))
    return result


@pytest.mark.parametrize("kill_after_step", [4, 8])
def test_sigkill_and_resume_matches_uninterrupted(tmp_path, expected, kill_after_step):
    run = tmp_path / "killed"
    proc = launch(run)
    deadline = time.time() + 240
    # Kill once a checkpoint is complete (orbax renames it to its step number on commit), so
    # the restart must resume rather than start over.
    while max(losses(run), default=0) < kill_after_step or not committed(run):
        assert proc.poll() is None and time.time() < deadline, "run ended before the kill"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = max(losses(run))
    assert killed_at < STEPS, "killed too late to test resuming"
    saved = max(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())
    logged_before = len(metric_steps(run))

    log = finish(launch(run))
    assert "resumed from" in log
    # The restart ran the steps after the checkpoint only: a restart from scratch would
    # give the same losses, but not these steps.
    assert metric_steps(run)[logged_before:] == list(range(saved + 1, STEPS + 1))
    assert losses(run) == expected  # Bitwise: the same floats at every step.


def metric_steps(workdir) -> list[int]:
    """Every logged step, in order, repeats included."""
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["step"] for line in lines if line.strip()]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_saves_the_step_and_resume_recomputes_nothing(tmp_path, expected, signum):
    """SIGTERM (what SLURM and Kubernetes send) or Ctrl-C: the run finishes its step, saves it
    (no checkpoint is due before the last step, so the save is the signal's), says so in one
    line and exits 128 + signal; the same command then runs the remaining steps only, to the
    same losses as an uninterrupted run, bitwise."""
    run, rare = tmp_path / "stopped", f"--config.checkpoint.every_steps={STEPS}"
    proc = launch(run, rare)
    deadline = time.time() + 240
    while max(losses(run), default=0) < 4:
        assert proc.poll() is None and time.time() < deadline, "run ended before the signal"
        time.sleep(0.05)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signum, err
    stopped_at = max(losses(run))
    assert stopped_at < STEPS, "stopped too late to test resuming"
    last = err.strip().splitlines()[-1]
    name = signal.Signals(signum).name
    assert last.startswith(f"stopped by {name} after step {stopped_at}, saved in "), last
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert (run / "checkpoints" / str(stopped_at)).is_dir()

    log = finish(launch(run, rare))
    assert f"resumed from {run / 'checkpoints' / str(stopped_at)}" in log
    assert metric_steps(run) == list(range(1, STEPS + 1))  # No step ran twice.
    assert losses(run) == expected
    # Once more: nothing left to do, and it says so.
    assert "nothing to do: the run is at step 12" in finish(launch(run, rare))
    assert metric_steps(run) == list(range(1, STEPS + 1))
