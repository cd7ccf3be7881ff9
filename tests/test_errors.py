"""Bad settings and inputs fail early with one line naming the setting and the fix.

Mesh and sharding checks are tested in-process; a representative few run through the launcher,
which must print exactly one `error:` line, no traceback, and exit non-zero. Checkpoints: a save
and restore round trip, and damaged checkpoints reported as one line naming the directory.
"""

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from angel_jax import machine
from angel_jax.checkpoint import Checkpointer, SaveFailed
from angel_jax.config import ConfigError, default_config, load_config
from angel_jax.data import ByteTokenizer
from angel_jax.data.prepare import prepare
from angel_jax.data.tokens import TokenFile, load_tokenizer, save_token_file
from angel_jax.generate import main as generate_main
from angel_jax.lock import hold_workdir
from angel_jax.mesh import make_mesh, mesh_shape
from angel_jax.monitor import EXIT_SAVE_FAILED
from angel_jax.planning.tiers import measured_budget
from angel_jax.sharding import axis_rules
from angel_jax.train import build

REPO = pathlib.Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny.py")
CLI_ENV = {
    **os.environ,
    "JAX_PLATFORMS": "cpu",
    "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
}
# Small enough that a run which gets as far as training compiles quickly.
SMALL = [
    "--config.train.steps=2",
    "--config.train.batch_size=8",
    "--config.train.seq_len=16",
    "--config.train.tensorboard=false",
    "--config.model.num_layers=1",
]


def launch(workdir, *overrides: str, config: str = "configs/tiny.py"):
    return subprocess.run(
        [sys.executable, "-m", "angel_jax.launch", "--config", config, "--workdir", str(workdir)]
        + SMALL
        + list(overrides),
        cwd=REPO,
        env=CLI_ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )


def assert_one_line_error(result, *names: str) -> str:
    assert result.returncode != 0, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    for name in names:
        assert name in lines[0]
    return lines[0]


# --- mesh sizes, in-process ----------------------------------------------------------------


def mesh_config(**sizes):
    mesh = default_config().mesh
    mesh.update(sizes)
    return mesh


@pytest.mark.parametrize(
    "sizes, devices, expected",
    [
        ({}, 8, dict(data=8)),
        (dict(data=-1, tensor=4), 8, dict(data=2, tensor=4)),
        (dict(data=2, tensor=-1), 8, dict(data=2, tensor=4)),
        (dict(data=2, tensor=4), 8, dict(data=2, tensor=4)),
        (dict(data=-1, tensor=2), 2, dict(data=1, tensor=2)),
    ],
)
def test_mesh_shape_resolves_free_axis(sizes, devices, expected):
    shape = mesh_shape(mesh_config(**sizes), devices)
    assert shape == {**dict.fromkeys(shape, 1), **expected}
    assert list(shape) == ["data", "pipeline", "expert", "context", "sequence", "tensor"]


@pytest.mark.parametrize(
    "sizes, names",
    [
        (dict(data=3), ["config.mesh", "multiply to 3", "8 devices", "set one axis to -1"]),
        (dict(data=2, tensor=2), ["data=2 x tensor=2", "multiply to 4"]),
        (dict(tensor=-1), ["only one axis may be -1", "data, tensor"]),
        (dict(data=-1, tensor=3), ["fixed axes multiply to 3", "config.mesh.data=-1"]),
        (dict(data=-1, tensor=16), ["fixed axes multiply to 16"]),
        (dict(data=8, tensor=0), ["config.mesh.tensor=0", "positive or -1"]),
        (dict(data=-1, tensor=-2), ["config.mesh.tensor=-2"]),
    ],
)
def test_bad_mesh_sizes(sizes, names):
    with pytest.raises(ConfigError) as e:
        mesh_shape(mesh_config(**sizes), 8)
    for name in names:
        assert name in str(e.value)


def test_make_mesh_uses_every_device():
    mesh = make_mesh(mesh_config(data=-1, tensor=2))
    assert dict(mesh.shape) == dict(data=4, pipeline=1, expert=1, context=1, sequence=1, tensor=2)
    assert mesh.size == len(jax.devices()) == 8


# --- shapes that do not divide over the mesh, in-process ------------------------------------


def rules_for(*overrides: str, data: int = -1, tensor: int = 1):
    config = load_config(TINY, list(overrides))
    return axis_rules(config, make_mesh(mesh_config(data=data, tensor=tensor)))


@pytest.mark.parametrize(
    "overrides, tensor, names",
    [
        ([], 8, ["config.model.num_heads=4 is not divisible by config.mesh.tensor=8"]),
        (
            ["--config.model.num_heads=8", "--config.model.ffn_dim=102"],
            4,
            ["config.model.ffn_dim=102", "config.mesh.tensor=4"],
        ),
        (["--config.model.vocab_size=257"], 2, ["config.model.vocab_size=257"]),
        (
            ["--config.model.num_heads=12", "--config.model.num_kv_heads=3"],
            4,
            ["config.model.num_kv_heads=3", "config.mesh.tensor=4"],
        ),
        (
            ["--config.model.sequence_parallel=true", "--config.train.seq_len=127"],
            2,
            ["config.train.seq_len=127", "config.mesh.tensor=2"],
        ),
    ],
)
def test_indivisible_over_tensor(overrides, tensor, names):
    with pytest.raises(ConfigError) as e:
        rules_for(*overrides, data=8 // tensor, tensor=tensor)
    for name in names:
        assert name in str(e.value)


@pytest.mark.parametrize(
    "overrides, names",
    [
        (["--config.train.batch_size=12"], ["config.train.batch_size", "config.mesh.data=8"]),
        (
            ["--config.train.batch_size=16", "--config.train.microbatches=4"],
            ["config.train.microbatches=4", "config.mesh.data=8"],
        ),
    ],
)
def test_indivisible_batch_over_data(overrides, names):
    with pytest.raises(ConfigError) as e:
        rules_for(*overrides)
    for name in names:
        assert name in str(e.value)


def test_kv_heads_split_or_replicated_over_tensor():
    assert rules_for(data=2, tensor=4)["kv_heads"] is None  # 2 KV heads, 4 ranks.
    assert rules_for(data=4, tensor=2)["kv_heads"] == "tensor"
    assert rules_for(data=4, tensor=2)["heads"] == "tensor"


# --- through the launcher ------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, names",
    [
        (["--config.mesh.data=3"], ["config.mesh", "8 devices"]),
        (["--config.mesh.tensor=-1"], ["config.mesh", "only one axis may be -1"]),
        (
            ["--config.mesh.data=1", "--config.mesh.tensor=8"],
            ["config.model.num_heads=4", "config.mesh.tensor=8"],
        ),
        (["--config.model.num_kv_heads=3"], ["config.model.num_kv_heads=3"]),
        (["--config.train.batch_size=12"], ["config.train.batch_size", "config.mesh.data=8"]),
        (["--config.train.microbatches=0"], ["config.train.microbatches=0"]),
        (["--config.data.path=/nonexistent.npy"], ["config.data.path=/nonexistent.npy", "prepare"]),
        (["--config.train.stpes=2"], ["--config.train.stpes", "did you mean steps?"]),
        (["--config.train.steps=two"], ["--config.train.steps=two", "expected int"]),
        (["--config.data.synthetic=maybe"], ["--config.data.synthetic=maybe", "true or false"]),
        (["--config.model.remat=dots_attn"], ["config.model.remat='dots_attn'", "dots_attention?"]),
        (["--config.data.path="], ["config.data.path is empty", "data.prepare"]),
        (["--workdri", "x"], ["unknown flag --workdri; did you mean --workdir?"]),
    ],
    ids=[
        "mesh-product",
        "two-free-axes",
        "heads-over-tensor",
        "heads-over-kv-heads",
        "batch-over-data",
        "zero-microbatches",
        "missing-data-file",
        "unknown-key",
        "wrong-type",
        "bad-bool",
        "misspelt-value",
        "empty-data-path",
        "misspelt-flag",
    ],
)
def test_cli_one_line_error(tmp_path, overrides, names):
    assert_one_line_error(launch(tmp_path, *overrides), *names)
    assert not (tmp_path / "checkpoints").exists()


def test_cli_missing_config_file(tmp_path):
    result = launch(tmp_path, config="configs/nope.py")
    assert_one_line_error(result, "--config configs/nope.py", "configs/tiny.py")


def test_cli_token_file_vocab_larger_than_model(tmp_path):
    path = tmp_path / "tokens.npy"
    save_token_file(str(path), np.arange(300, dtype=np.uint16) % 257, ByteTokenizer())
    result = launch(tmp_path, f"--config.data.path={path}", "--config.model.vocab_size=256")
    assert_one_line_error(
        result, f"config.data.path={path}", "256", "set config.model.vocab_size >= 257"
    )


# --- checkpoints ---------------------------------------------------------------------------


def small_experiment(*overrides: str):
    config = load_config(TINY, SMALL + list(overrides))
    return build(config, make_mesh(config.mesh))


def scrambled_state(exp):
    """A state shaped and placed like the real one with every leaf random, so that a restore
    cannot pass by reading back zeros (built on the host: jitting random fills is slow)."""
    rng = np.random.default_rng(0)

    def leaf(abstract):
        if jnp.issubdtype(abstract.dtype, jnp.floating):
            value = rng.standard_normal(abstract.shape).astype(abstract.dtype)
        else:
            value = rng.integers(1, 1000, abstract.shape).astype(abstract.dtype)
        return jax.device_put(value, abstract.sharding)

    return jax.tree.map(leaf, exp.abstract_state)


@pytest.mark.parametrize("zero_stage", [1, 3])
def test_checkpoint_round_trip(tmp_path, zero_stage):
    exp = small_experiment(f"--config.zero_stage={zero_stage}")
    state = scrambled_state(exp)
    ckpt = Checkpointer(str(tmp_path), every_steps=5, keep=2, async_save=True)
    ckpt.save(7, state, data_index=11)
    ckpt.close()

    ckpt = Checkpointer(str(tmp_path), every_steps=5, keep=2)
    assert ckpt.latest_step() == 7
    restored, data_index = ckpt.restore(7, exp.abstract_state)
    ckpt.close()
    assert data_index == 11
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    for path, want, got, sharding in zip(
        jax.tree_util.tree_leaves_with_path(state),
        jax.tree.leaves(state),
        jax.tree.leaves(restored),
        jax.tree.leaves(exp.state_sharding),
        strict=True,
    ):
        assert got.dtype == want.dtype and got.shape == want.shape, path[0]
        assert got.sharding == sharding, path[0]
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=str(path[0]))


def test_checkpointer_keeps_the_latest(tmp_path):
    ckpt = Checkpointer(str(tmp_path), every_steps=1, keep=2, async_save=False)
    for step in (1, 2, 3):
        ckpt.save(step, {"w": jnp.full((4,), step, jnp.float32)}, data_index=10 * step)
    ckpt.close()
    assert sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir()) == [2, 3]
    ckpt = Checkpointer(str(tmp_path), every_steps=1, keep=2)
    abstract = {"w": jax.ShapeDtypeStruct((4,), jnp.float32)}
    state, data_index = ckpt.restore(ckpt.latest_step(), abstract)
    ckpt.close()
    np.testing.assert_array_equal(state["w"], [3.0] * 4)
    assert data_index == 30


def test_checkpointer_workdir_not_a_directory(tmp_path):
    workdir = tmp_path / "a_file"
    workdir.write_text("")
    with pytest.raises(ConfigError) as e:
        Checkpointer(str(workdir), every_steps=1, keep=1)
    assert str(e.value).startswith(f"--workdir {workdir}: cannot create {workdir}/checkpoints")


def test_should_save():
    ckpt = object.__new__(Checkpointer)  # should_save needs no directory.
    ckpt.every_steps = 3
    assert [s for s in range(1, 9) if ckpt.should_save(s, last_step=7)] == [3, 6, 7]
    ckpt.every_steps = 0
    assert not any(ckpt.should_save(s, last_step=7) for s in range(1, 9))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A workdir after 2 steps of the launcher with a checkpoint at every step."""
    workdir = tmp_path_factory.mktemp("trained")
    result = launch(
        workdir,
        "--config.data.synthetic=true",
        "--config.checkpoint.every_steps=1",
        "--config.train.log_every_steps=1",
    )
    assert result.returncode == 0, result.stderr
    steps = [json.loads(line)["step"] for line in (workdir / "metrics.jsonl").open()]
    assert steps == [1, 2]
    return workdir


def test_trained_checkpoint_restores(trained):
    exp = small_experiment("--config.data.synthetic=true")
    ckpt = Checkpointer(str(trained), every_steps=1, keep=3)
    assert ckpt.latest_step() == 2
    state, data_index = ckpt.restore(2, exp.abstract_state)
    ckpt.close()
    assert int(state.step) == 2 and data_index == 2


def truncate_all(step_dir: pathlib.Path) -> None:
    for f in step_dir.rglob("*"):
        if f.is_file():
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def empty_manifests(step_dir: pathlib.Path) -> None:
    manifests = list(step_dir.rglob("manifest.ocdbt"))
    assert manifests
    for f in manifests:
        f.write_bytes(b"")


def scribble_on_arrays(step_dir: pathlib.Path) -> None:
    chunks = [f for f in (step_dir / "state").rglob("*") if f.is_file() and f.parent.name == "d"]
    assert chunks
    rng = np.random.default_rng(0)
    for f in chunks:
        f.write_bytes(rng.bytes(f.stat().st_size))


def damage_data_item(step_dir: pathlib.Path) -> None:
    for f in (step_dir / "data").rglob("*"):
        if f.is_file():
            f.write_text("{not json")


@pytest.mark.parametrize(
    "damage", [truncate_all, empty_manifests, scribble_on_arrays, damage_data_item]
)
def test_cli_corrupt_checkpoint(trained, tmp_path, damage):
    """Every checkpoint damaged: one line naming the newest (nothing is set aside), and no
    other output (orbax's abandoned reads once printed hundreds of coroutine lines). A
    truncated newest one alone is in test_cli_truncated_latest_checkpoint_falls_back."""
    workdir = tmp_path / "run"
    shutil.copytree(trained, workdir)
    damage(workdir / "checkpoints" / "2")
    damage(workdir / "checkpoints" / "1")
    result = launch(workdir, "--config.data.synthetic=true", "--config.checkpoint.every_steps=1")
    line = assert_one_line_error(
        result,
        f"none of the checkpoints in {workdir / 'checkpoints'} (steps 2, 1) can be read",
        f"the newest, {workdir / 'checkpoints' / '2'}: ",
    )
    assert "the config they were saved with" in line
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["1", "2"]
    assert "reading step 2 failed" in (workdir / "orbax.log").read_text()  # orbax's report.


def test_cli_truncated_latest_checkpoint_falls_back(trained, tmp_path):
    """A truncated newest checkpoint is detected; the run resumes from the one before, sets the
    damaged one aside and trains on, saving a good checkpoint in its place."""
    workdir = tmp_path / "run"
    shutil.copytree(trained, workdir)
    truncate_all(workdir / "checkpoints" / "2")
    result = launch(workdir, "--config.data.synthetic=true", "--config.checkpoint.every_steps=1")
    assert result.returncode == 0, result.stderr
    (warning,) = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert f"warning: checkpoint {workdir / 'checkpoints' / '2'} is unreadable" in warning
    assert "pybind11" not in warning and "<bound method" not in warning, warning
    assert f"resumed from {workdir / 'checkpoints' / '1'}" in result.stderr
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == [
        "1",
        "2",
        "2.unreadable",
    ]
    (event,) = [json.loads(line) for line in (workdir / "events.jsonl").open()]
    assert event["kind"] == "unreadable_checkpoint" and event["step"] == 2
    exp = small_experiment("--config.data.synthetic=true")
    ckpt = Checkpointer(str(workdir), every_steps=1, keep=3)
    state, data_index = ckpt.restore(2, exp.abstract_state)
    ckpt.close()
    assert int(state.step) == 2 and data_index == 2


@pytest.mark.parametrize(
    "error",
    [
        jax.errors.JaxRuntimeError(
            "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 51539607552 bytes.\n"
            "BufferAssignment OOM Debugging.\n" + "x = f32[...] allocation\n" * 40
        ),
        MemoryError(),
    ],
)
def test_out_of_memory_is_one_line_and_its_own_exit_status(monkeypatch, capsys, error):
    """An allocation that failed would fail again on restart: one line naming what to change,
    and the exit status the supervisor does not restart (5)."""
    from angel_jax import launch, loop, monitor

    def oom(config, workdir):
        raise error

    monkeypatch.setattr(loop, "train_loop", oom)
    code = launch.main(["--config", "configs/tiny.py", "--workdir", "unused"])
    err = capsys.readouterr().err.strip()
    assert code == monitor.EXIT_OUT_OF_MEMORY == 5
    assert len(err.splitlines()) == 1 and err.startswith("error: out of memory"), err
    assert "config.train.batch_size" in err and "config.offload.policy=auto" in err


def test_other_runtime_errors_are_not_called_out_of_memory(monkeypatch):
    from angel_jax import launch, loop

    def fails(config, workdir):
        raise jax.errors.JaxRuntimeError("INTERNAL: something else")

    monkeypatch.setattr(loop, "train_loop", fails)
    with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL"):
        launch.main(["--config", "configs/tiny.py", "--workdir", "unused"])


def test_checkpoint_reasons_are_short_whole_lines():
    """What orbax says reaches the user as one line: no object reprs, no word cut in two."""
    from angel_jax.checkpoint import one_line_reason

    bound = "<bound method pybind11_detail_function_record_v1.get of <obj at 0x7f3a>>"
    reason = one_line_reason(ValueError(f"Failed to read {bound} from zarr\nTraceback ..."))
    assert reason == "Failed to read from zarr"
    words = " ".join(f"word{i}" for i in range(100))
    reason = one_line_reason(ValueError(words))
    assert len(reason) <= 204 and reason.endswith(" ...")
    assert all(w in words.split() for w in reason[:-4].split())  # Whole words only.
    assert one_line_reason(KeyError()) == "KeyError"


def test_cpu_plan_is_checked_against_the_compiled_step_before_allocating():
    """Issue row: a batch the planner's activation estimate let through ran out of memory
    mid-step. On a CPU the budget is the machine's RAM and the compiled step's memory is
    checked against it before the state exists: a batch between what the estimate and what
    the compiled step need per row is refused so."""

    def tiny(batch):
        c = load_config("configs/tiny.py", ["--config.mesh.data=1"])
        c.train.batch_size = batch
        return build(c, make_mesh(c.mesh, jax.devices()[:1]))

    small = tiny(64)
    b = small.plan.state_bytes
    estimate = (b["activations"] + b["layer inputs"]) / 64  # Per row.
    compiled = small.steps.lowered().compile().memory_analysis().temp_size_in_bytes / 64
    assert compiled > 1.05 * estimate  # XLA's temporaries outgrow the estimate here.
    usable = 0.95 * small.plan.budget["device"]
    rows = int(usable / ((estimate + compiled) / 2)) // 16 * 16  # Fits by the estimate only.
    exp = tiny(rows)  # The planner lets it through...
    with pytest.raises(ConfigError, match=r"the compiled train step needs .* GiB usable"):
        _ = exp.train_step  # ...and the compiled step is refused before anything is allocated.


# --- the workdir: one run at a time, a disk that fills ------------------------------------


def test_a_second_run_on_a_held_workdir_exits_2_naming_the_holder(tmp_path):
    """A job submitted twice once ran twice in one workdir, interleaving its metrics and
    checkpoints; the second now stops before it writes anything."""
    with hold_workdir(str(tmp_path)):
        result = launch(tmp_path)
    assert result.returncode == 2
    assert_one_line_error(result, "--workdir", "in use by another run", f"pid {os.getpid()}")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock"]


def test_a_workdir_that_cannot_be_written_is_one_line(tmp_path):
    """A read-only workdir once gave a traceback (the lock's file stands for any file there
    that cannot be written: root writes into read-only directories)."""
    (tmp_path / ".lock").mkdir()
    with pytest.raises(ConfigError, match=r"--workdir .*: cannot write there \(Is a directory"):
        with hold_workdir(str(tmp_path)):
            pass


def test_a_killed_run_leaves_its_workdir_free(tmp_path):
    code = (
        "import os, signal, sys\n"
        "from angel_jax.lock import hold_workdir\n"
        "with hold_workdir(sys.argv[1]):\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    killed = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], cwd=REPO, env=CLI_ENV)
    assert killed.wait(timeout=60) == -9
    assert f"pid {killed.pid}" in (tmp_path / ".lock").read_text()  # It held the workdir.
    with hold_workdir(str(tmp_path)):
        assert f"pid {os.getpid()}" in (tmp_path / ".lock").read_text()


def test_a_failed_save_stops_the_run_and_keeps_the_last_checkpoint(trained, tmp_path):
    """A write refused mid-save (the kernel's file-size limit: a full disk refuses the same
    way) once printed 471 lines and trained to the end; now: one line naming the checkpoint,
    its disk's free space and the last good checkpoint, an exit status supervise does not
    restart, and the last good checkpoint still the latest."""
    shutil.copytree(trained, tmp_path, dirs_exist_ok=True)  # Saved at step 2.
    every = ["--config.checkpoint.every_steps=2", "--config.data.synthetic=true"]
    limited = (  # The file-size limit below the arrays' files, set in the launcher's process.
        "import resource, runpy, sys\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))\n"
        "sys.argv[0] = 'angel_jax.launch'\n"
        "runpy.run_module('angel_jax.launch', run_name='__main__')\n"
    )
    env = {k: v for k, v in CLI_ENV.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    result = subprocess.run(
        [sys.executable, "-c", limited, "--config", "configs/tiny.py"]
        + ["--workdir", str(tmp_path), *SMALL, *every, "--config.train.steps=6"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == EXIT_SAVE_FAILED, result.stderr
    assert "Traceback" not in result.stderr and "orbax" not in result.stderr.split("error:")[0]
    (error,) = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    checkpoints = tmp_path / "checkpoints"
    assert error.startswith(f"error: saving checkpoint {checkpoints / '4'} failed (File too large)")
    assert "free on its disk" in error
    assert f"the last good checkpoint, {checkpoints / '2'}, is intact" in error
    # The save's failure is known when its writes end, steps later (it runs beside them):
    # the run stops there, and saves nothing after it.
    assert sorted(p.name for p in checkpoints.iterdir() if p.name[0].isdigit())[-1] != "6"
    assert "saving step 4 failed" in (tmp_path / "orbax.log").read_text()
    exp = small_experiment("--config.data.synthetic=true")
    ckpt = Checkpointer(str(tmp_path), every_steps=2, keep=3)
    assert ckpt.latest_step() == 2
    state, _ = ckpt.restore(2, exp.abstract_state)
    ckpt.close()
    assert int(state.step) == 2


def test_a_checkpoint_larger_than_the_free_space_is_refused_before_it_is_written(tmp_path):
    ckpt = Checkpointer(str(tmp_path), every_steps=1, keep=1)
    free = shutil.disk_usage(tmp_path).free
    fits = {"w": jax.ShapeDtypeStruct((free // 8,), jnp.float32)}  # Half the free space.
    ckpt.check_space(fits)
    too_large = {"w": jax.ShapeDtypeStruct((free // 4 + 1,), jnp.float32)}
    with pytest.raises(SaveFailed, match=r"the next checkpoint needs .* GiB free; free space"):
        ckpt.check_space(too_large)
    ckpt.close()


def test_a_changed_model_resumes_to_one_line(trained, tmp_path):
    """Once 60 to 1,365 lines of orbax's abandoned reads followed the error line; now the
    shapes are compared before anything is read, and the line names the setting that changed
    (tests/test_elastic_resume.py: a changed vocabulary too)."""
    workdir = tmp_path / "run"
    shutil.copytree(trained, workdir)
    result = launch(workdir, "--config.data.synthetic=true", "--config.model.d_model=256")
    assert_one_line_error(
        result, "holds a model of other shapes", "config.model.d_model=128 (this run: 256)"
    )
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["1", "2"]


def test_emulated_cpu_devices_share_the_hosts_memory():
    """Eight emulated devices each planned against the whole RAM let through a batch that
    needed twice the machine's memory."""
    config = load_config(TINY, [])
    budget = measured_budget(config, make_mesh(config.mesh).size)
    assert jax.device_count() == 8
    assert 8 * budget["device"] <= machine.host_available() * 1.05  # RAM moves a little.
    one = measured_budget(config, make_mesh(config.mesh, jax.devices()[:1]).size)
    assert one["device"] > 4 * budget["device"]


def test_generate_names_a_wrong_checkpoint_path_in_one_line_and_creates_nothing(
    trained, tmp_path, capsys
):
    """A missing directory, a run without checkpoints and one checkpoint's directory once
    gave the error and 42 lines of orbax's futures, and created PATH/checkpoints/."""
    (tmp_path / "empty").mkdir()
    step_dir = trained / "checkpoints" / "2"
    cases = {
        tmp_path / "missing": "no such directory",
        tmp_path / "empty": "no checkpoint there",
        step_dir: f"is one checkpoint's directory; pass the run's workdir, {trained}",
    }
    before = sorted(str(p) for p in trained.rglob("*"))
    for path, says in cases.items():
        argv = ["--config", TINY, "--checkpoint", str(path), "--prompt-tokens", "1,2"]
        assert generate_main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"error: --checkpoint {path}"), err
        assert says in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]
    assert not any((tmp_path / "empty").iterdir())
    assert sorted(str(p) for p in trained.rglob("*")) == before


# --- messages that named the wrong cause ------------------------------------------------


def test_data_and_prepare_inputs_are_named_for_what_they_are(tmp_path):
    (tmp_path / "zero.npy").write_bytes(b"")
    (tmp_path / "noise.bin").write_bytes(np.random.default_rng(0).bytes(100_000))
    (tmp_path / "text.txt").write_text("héllo wörld\n")
    cases = [
        (lambda: TokenFile(str(tmp_path)), f"config.data.path={tmp_path} is a directory"),
        (lambda: TokenFile(str(tmp_path / "zero.npy")), "not a .npy token array"),
        (lambda: load_tokenizer(str(tmp_path / "none.json")), "no such file"),
        (lambda: prepare([str(tmp_path)], str(tmp_path / "o.npy")), "is a directory"),
        (lambda: prepare([str(tmp_path / "noise.bin")], str(tmp_path / "o.npy")), "not text"),
    ]
    for make, says in cases:
        with pytest.raises(ConfigError, match=re.escape(says)):
            make()
    assert prepare([str(tmp_path / "text.txt")], str(tmp_path / "o.npy"))["tokens"] == 15


def test_a_mesh_short_of_the_flags_devices_says_jax_started_before_them(monkeypatch):
    """A notebook that imported jax before setting XLA_FLAGS got "multiply to 8, but there
    are 1 devices" and no hint why."""
    assert len(jax.devices()) == 8  # JAX has started, with the conftest's flags.
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=16")
    with pytest.raises(ConfigError, match="JAX had started before it was set"):
        make_mesh(mesh_config(data=16))
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    with pytest.raises(ConfigError) as e:
        make_mesh(mesh_config(data=16))
    assert "XLA_FLAGS" not in str(e.value)
