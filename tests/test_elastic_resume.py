"""Elastic resume: a run interrupted on one mesh resumes on another (other device or process
count, data x tensor, ZeRO stage, pipeline, offloaded or not) to the losses of the run that was
never interrupted, and reads each batch once: the checkpoint's data position is the global
batch index, and the step carries the learning-rate schedule on.

Tolerance: float32 compute, losses within rtol 1e-5 of the uninterrupted run's. Another mesh
adds its partial sums in another order (all-reduce over other groups, a pipeline's
microbatches); seen here: at most 1.5e-7 relative. A bfloat16 model would need about 1e-4
(tests/test_offload_masters.py: one bfloat16 rounding flipped).
"""

import shutil

import jax
import numpy as np
import pytest

from angel_jax import monitor
from angel_jax.checkpoint import Checkpointer
from angel_jax.config import ConfigError, load_config
from angel_jax.data.loader import Batches
from angel_jax.elastic import Reshard
from angel_jax.loop import train_loop
from angel_jax.mesh import make_mesh
from angel_jax.train import build
from tests.runs import losses
from tests.test_multiprocess import launch_all

STEPS = 6
ARGS = [
    f"--config.train.steps={STEPS}",
    "--config.train.batch_size=8",
    "--config.train.seq_len=32",
    "--config.train.log_every_steps=1",
    "--config.train.tensorboard=false",
    "--config.model.num_layers=3",  # Two pipeline stages of 2 and 1 layers: padded slots.
    "--config.model.dtype=float32",
    "--config.data.synthetic=true",
    "--config.checkpoint.every_steps=2",
    "--config.checkpoint.async_save=false",
    "--config.offload.device_gib=1",
    "--config.zero_stage=1",
]
DATA8 = ["--config.mesh.data=8"]
RTOL = 1e-5


def config(overrides):
    return load_config("configs/tiny.py", ARGS + overrides)


@pytest.fixture
def read(monkeypatch):
    """The batch indices each run reads, in order: `read[-1]` is the last run's."""
    runs = []
    iterate = Batches.iterate

    def spied(self, start):
        runs.append([])
        for index, rows in enumerate(iterate(self, start), start):
            runs[-1].append(index)
            yield rows

    monkeypatch.setattr(Batches, "iterate", spied)
    return runs


def train(workdir, overrides, devices=None, stop_after=None):
    """Trains in `workdir` (from its latest checkpoint) on a mesh over `devices`; with
    `stop_after`, stops there as on SIGTERM (a save of that step, then `Stopped`)."""
    after = monitor.StopRequest.after

    def stop_at(self, step):
        if step == stop_after:
            self.signum = 15
        return after(self, step)

    monitor.StopRequest.after = stop_at
    try:
        train_loop(config(overrides), str(workdir), devices)
        assert stop_after is None, "ran to the end"
    except monitor.Stopped:
        assert stop_after is not None
    finally:
        monitor.StopRequest.after = after


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run on data=8: its workdir (checkpoints at 2, 4, 6) and losses."""
    workdir = tmp_path_factory.mktemp("reference")
    train(workdir, DATA8)
    result = losses(workdir)
    assert sorted(result) == list(range(1, STEPS + 1))
    return workdir, result


def from_reference(reference, tmp_path, step=2):
    """A workdir holding the reference's checkpoint of `step`: a run interrupted there."""
    workdir = tmp_path / "run"
    shutil.copytree(reference[0] / "checkpoints" / str(step), workdir / "checkpoints" / str(step))
    return workdir


def assert_continues(workdir, reference, steps):
    got = losses(workdir)
    np.testing.assert_allclose([got[s] for s in steps], [reference[1][s] for s in steps], RTOL)


def test_data8_resumes_on_data4_tensor2(reference, tmp_path, read):
    workdir = from_reference(reference, tmp_path)
    train(workdir, ["--config.mesh.data=4", "--config.mesh.tensor=2"])
    assert read == [[2, 3, 4, 5]]  # From the saved position on: none twice, none skipped.
    assert_continues(workdir, reference, range(3, STEPS + 1))


def test_zero1_resumes_on_zero3_and_back(reference, tmp_path, read):
    workdir = from_reference(reference, tmp_path)
    train(workdir, [*DATA8, "--config.zero_stage=3"], stop_after=4)
    train(workdir, DATA8)
    assert read == [[2, 3], [4, 5]]
    assert_continues(workdir, reference, range(3, STEPS + 1))


def test_fewer_devices_8_to_4_to_2(reference, tmp_path, read):
    workdir = from_reference(reference, tmp_path)
    train(workdir, ["--config.mesh.data=4"], jax.devices()[:4], stop_after=4)
    train(workdir, ["--config.mesh.data=2"], jax.devices()[:2])
    assert read == [[2, 3], [4, 5]]
    assert_continues(workdir, reference, range(3, STEPS + 1))


def test_pipeline_2_resumes_on_pipeline_1(reference, tmp_path, read):
    """Stages of 2 and 1 layers store 4 layer slots (one padding): the resume restacks them."""
    workdir = tmp_path / "run"
    pipelined = ["--config.mesh.data=4", "--config.mesh.pipeline=2"]
    train(workdir, [*pipelined, "--config.pipeline.microbatches=2"], stop_after=2)
    train(workdir, DATA8)
    assert read == [[0, 1], [2, 3, 4, 5]]
    assert_continues(workdir, reference, range(1, STEPS + 1))


def test_offloaded_resumes_on_the_device_and_back(reference, tmp_path, read):
    offloaded = [*DATA8, "--config.offload.policy=optimizer"]
    workdir = tmp_path / "run"
    train(workdir, offloaded, stop_after=2)
    train(workdir, DATA8, stop_after=4)
    train(workdir, offloaded)
    assert read == [[0, 1], [2, 3], [4, 5]]
    assert_continues(workdir, reference, range(1, STEPS + 1))


def test_two_processes_resume_as_one(reference, tmp_path, read):
    """Two processes of 2 devices (data=4) are killed before step 3; one process of 8
    devices (data=8) resumes from their checkpoint of step 2."""
    workdir = tmp_path / "run"
    args = ["--config", "configs/tiny.py", *ARGS, "--config.mesh.data=4"]
    results = launch_all(workdir, 2, args, "crash@3")
    assert [code for code, _ in results] == [-9, -9], results[0][1][-2000:]
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["2"]
    train(workdir, DATA8)
    assert read == [[2, 3, 4, 5]]
    assert_continues(workdir, reference, range(1, STEPS + 1))


@pytest.mark.parametrize(
    "override, says",
    [
        ("--config.model.d_model=256", "config.model.d_model=128 (this run: 256)"),
        ("--config.model.vocab_size=1024", "config.model.vocab_size=512 (this run: 1024)"),
    ],
)
def test_a_resume_that_cannot_work_names_the_setting(reference, override, says):
    """Another model cannot resume: one line naming what changed, and the fix."""
    c = config([*DATA8, override])
    exp = build(c, make_mesh(c.mesh))
    ckpt = Checkpointer(str(reference[0]), 2, 3, read_only=True)
    try:
        with pytest.raises(ConfigError) as error:
            ckpt.restore_latest(exp.checkpoint_target(), *exp.checkpoint_layout, Reshard(exp))
    finally:
        ckpt.close()
    message = str(error.value)
    assert "\n" not in message and says in message, message
    assert f"resume with {override.replace('256', '128').replace('1024', '512')}" in message
