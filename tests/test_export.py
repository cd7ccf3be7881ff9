"""`python -m angel_jax.export`: a tiny Llama's and Mixtral's training runs exported to Hugging
Face directories, imported back through config.init_from_hf (the same params, the same logits),
sharded above --max-shard-size, readable by others, and loaded by transformers with our logits.
Refusals are one line."""

import json
import pathlib
import shutil
import subprocess
import sys
import types

import jax
import numpy as np
import pytest

from angel_jax import export, generate, sharding
from angel_jax.checkpoint import Checkpointer
from angel_jax.config import load_config
from angel_jax.data.tokens import save_token_file
from angel_jax.interop import hf
from angel_jax.interop.llama import ARCHITECTURES
from angel_jax.loop import train_loop
from angel_jax.mesh import make_mesh
from angel_jax.train import build
from tests.conftest import hf_reference
from tests.runs import ROOT, env
from tests.test_generate_cli import one_error_line

VOCAB = 256
SMALL = [
    "--config.model.num_layers=2",
    "--config.model.d_model=64",
    "--config.model.ffn_dim=96",
    f"--config.model.vocab_size={VOCAB}",
    "--config.model.dtype=float32",
    "--config.train.steps=2",
    "--config.train.batch_size=8",
    "--config.train.seq_len=16",
    "--config.train.tensorboard=false",
    "--config.checkpoint.every_steps=2",
]
# name -> (config file, its overrides). The Llama reads a token file made with a Hugging Face
# tokenizer (its path is added in `trained`); Mixtral routes as Hugging Face's does (dropless).
RUNS = {
    "llama": ("configs/tiny.py", SMALL),
    "mixtral": (
        "configs/mixtral_tiny.py",
        [*SMALL, "--config.model.num_experts=4", "--config.model.moe_ffn_dim=48"]
        + ["--config.model.router=dropless", "--config.data.synthetic=true"],
    ),
}


def make_token_file(directory: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    """(token file, the tokenizer.json its sidecar names): random tokens, as `prepare` writes
    them; the tokenizer file is only copied by the export, never parsed."""
    tokenizer = directory / "tokenizer.json"
    tokenizer.write_text('{"version": "1.0", "model": {"type": "WordLevel"}}\n')
    tokens = np.random.default_rng(0).integers(0, VOCAB - 1, 4096).astype(np.uint16)
    named = types.SimpleNamespace(name=str(tokenizer), vocab_size=VOCAB, eos_id=VOCAB - 1)
    save_token_file(str(directory / "tokens.npy"), tokens, named)
    return directory / "tokens.npy", tokenizer


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """name -> a run trained two steps in-process: (its config argv, workdir, tokenizer.json
    or None). Each is trained once, when a test first asks for it."""
    runs = {}

    def get(name: str):
        if name not in runs:
            directory = tmp_path_factory.mktemp(name)
            path, overrides = RUNS[name]
            tokenizer = None
            if name == "llama":
                tokens, tokenizer = make_token_file(directory)
                overrides = [*overrides, f"--config.data.path={tokens}"]
            argv = ["--config", str(ROOT / path), *overrides]
            train_loop(load_config(str(ROOT / path), overrides), str(directory / "run"))
            runs[name] = (argv, directory / "run", tokenizer)
        return runs[name]

    return get


def run_export(argv: list[str], workdir, out, *flags: str) -> int:
    return export.main([*argv, "--checkpoint", str(workdir), "--out", str(out), *flags])


def restored(argv: list[str], workdir):
    """(experiment, params) of the run's latest checkpoint, as generate restores it."""
    config = load_config(argv[1], argv[2:])
    exp = build(config, make_mesh(config.mesh), fit_compiled=False)
    return exp, generate.load_params_for(exp, str(workdir))


def imported(argv: list[str], out):
    """(experiment, params) of a run started from `out` with config.init_from_hf."""
    config = load_config(argv[1], [*argv[2:], f"--config.init_from_hf={out}"])
    exp = build(config, make_mesh(config.mesh), fit_compiled=False)
    return exp, exp.init_state().params


def logits(exp, params, tokens: np.ndarray) -> np.ndarray:
    with sharding.use_rules(exp.mesh, exp.rules):
        apply = jax.jit(lambda p, t: exp.model.apply({"params": p}, t))
        return np.asarray(apply(params, tokens))


def assert_same(params, expected) -> None:
    """Bit for bit, leaf by leaf."""
    assert jax.tree.structure(params) == jax.tree.structure(expected)
    leaves = zip(
        jax.tree.leaves(params), jax.tree_util.tree_leaves_with_path(expected), strict=True
    )
    for a, (path, b) in leaves:
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(path))


def assert_readable(out: pathlib.Path) -> None:
    """Every file readable by all (0644 under the usual umask), though safetensors writes its
    own 0600."""
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in out.iterdir()}
    assert all(int(m, 8) & 0o444 == 0o444 for m in modes.values()), modes


TOKENS = np.random.default_rng(1).integers(0, VOCAB, (8, 16)).astype(np.int32)


@pytest.mark.parametrize("name", ["llama", "mixtral"])
def test_export_imports_back_with_the_trained_logits(name, trained, tmp_path):
    argv, workdir, tokenizer = trained(name)
    out = tmp_path / "hf"
    assert run_export([], workdir, out) == 0  # The config the run recorded.
    files = {"config.json", "model.safetensors"} | ({"tokenizer.json"} if tokenizer else set())
    assert {p.name for p in out.iterdir()} == files
    assert_readable(out)
    if tokenizer:  # The run's tokenizer, from its token file's sidecar.
        assert (out / "tokenizer.json").read_bytes() == tokenizer.read_bytes()
    assert json.loads((out / "config.json").read_text())["model_type"] == name

    exp, params = restored(argv, workdir)
    back_exp, back = imported(argv, out)
    assert_same(back, params)
    np.testing.assert_array_equal(logits(back_exp, back, TOKENS), logits(exp, params, TOKENS))


def test_generate_reads_the_runs_recorded_config(trained, capsys):
    argv, workdir, _ = trained("llama")
    flags = ["--checkpoint", str(workdir), "--prompt-tokens", "1,2,3", "--steps", "4"]
    assert generate.main(flags) == 0
    recorded = capsys.readouterr().out
    assert generate.main([*argv, *flags]) == 0
    assert recorded == capsys.readouterr().out


def test_a_workdir_without_its_config_needs_config_in_one_line(trained, tmp_path, capsys):
    _, workdir, _ = trained("llama")
    bare = tmp_path / "run"
    shutil.copytree(workdir, bare, ignore=shutil.ignore_patterns("config.json"))
    assert run_export([], bare, tmp_path / "hf") == 2
    line = one_error_line(capsys.readouterr().err)
    assert "no config.json there" in line and "pass --config" in line, line
    (bare / "config.json").write_text('{"model": {"d_model": "wide"}}')
    assert run_export([], bare, tmp_path / "hf") == 2
    line = one_error_line(capsys.readouterr().err)
    assert "config.json: cannot be read as a run's config" in line, line


def test_export_shards_above_max_shard_size_and_overwrites_only_when_told(
    trained, tmp_path, capsys
):
    argv, workdir, tokenizer = trained("llama")
    out = tmp_path / "hf"
    assert run_export(argv, workdir, out) == 0
    capsys.readouterr()

    # A second export into it is refused in one line naming the fix.
    assert run_export(argv, workdir, out, "--max-shard-size", "64KiB") == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: --out {out} is not empty"), err
    assert "--overwrite" in err[0]

    # A setting of how to compute (not in config.json) may differ from the run's.
    again = ("--max-shard-size", "64KiB", "--overwrite", "--config.model.remat=full")
    assert run_export(argv, workdir, out, *again) == 0
    index = json.loads((out / hf.INDEX_FILE).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2
    assert shards[-1] == f"model-{len(shards):05d}-of-{len(shards):05d}.safetensors"
    names = {p.name for p in out.iterdir()}
    assert names == {"config.json", hf.INDEX_FILE, "tokenizer.json", *shards}  # None stale.
    assert_readable(out)
    checkpoint = hf.Checkpoint(out)
    for shard in shards:  # At most 64 KiB of tensors, or one tensor alone.
        held = [checkpoint.read(n).nbytes for n, f in index["weight_map"].items() if f == shard]
        assert sum(held) <= 64 * 1024 or len(held) == 1, (shard, held)
    params = restored(argv, workdir)[1]
    back = imported(argv, out)[1]
    assert_same(back, params)


def test_a_pipeline_run_exports_its_layers_in_model_order(tmp_path):
    """A pipeline run stores its layers stage by stage (here 0, 2 on the first stage, 1, 3 on
    the second): the export names each by its place in the model."""
    pipeline = ["--config.mesh.pipeline=2", "--config.mesh.data=4", "--config.train.batch_size=32"]
    pipeline += ["--config.pipeline.schedule=circular", "--config.pipeline.virtual_stages=2"]
    argv = ["--config", str(ROOT / "configs/tiny.py"), *SMALL, "--config.model.num_layers=4"]
    config = load_config(argv[1], [*argv[2:], *pipeline])
    exp = build(config, make_mesh(config.mesh), fit_compiled=False)
    state = exp.init_state()  # Its layout is what matters here, not training.
    ckpt = Checkpointer(str(tmp_path / "run"), every_steps=1, keep=1, async_save=False)
    ckpt.save(1, exp.checkpointed(state), 1, *exp.checkpoint_layout)
    ckpt.close()
    assert run_export([*argv, *pipeline], tmp_path / "run", tmp_path / "hf") == 0

    slot_layer = exp.pipeline.layout.slot_layer
    assert list(slot_layer) == [0, 2, 1, 3]
    stored = jax.device_get(state.params)
    expected = dict(
        stored, layers=jax.tree.map(lambda x: x[np.argsort(slot_layer)], stored["layers"])
    )
    assert_same(imported(argv, tmp_path / "hf")[1], expected)


def test_a_workdir_as_init_from_hf_and_a_bad_out_are_refused_in_one_line(tmp_path, capsys):
    # A workdir as loop.py starts it, before its first checkpoint: the run's config.json.
    path, overrides = RUNS["mixtral"]
    argv = ["--config", str(ROOT / path), *overrides]
    workdir = tmp_path / "run"
    (workdir / "checkpoints").mkdir(parents=True)
    config = load_config(str(ROOT / path), overrides)
    (workdir / "config.json").write_text(config.to_json_best_effort(indent=1))

    def one_line_error(module: str, *args: str) -> str:
        """What the command prints, run as a user runs it: one line, no traceback."""
        result = subprocess.run(
            [sys.executable, "-m", module, *args],
            cwd=ROOT,
            env=env(8),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 2, result.stderr
        lines = result.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
        return lines[0]

    # Before: "model_type None () is not supported".
    init = f"--config.init_from_hf={workdir}"
    line = one_line_error("angel_jax.launch", *argv, "--workdir", str(tmp_path / "new"), init)
    assert f"config.init_from_hf={workdir} is an angel-jax training workdir" in line
    assert "--checkpoint" in line and "python -m angel_jax.export" in line

    # A model setting other than the run's config.json records is named with its fix.
    out = tmp_path / "out"
    line = one_line_error(
        "angel_jax.export",
        *argv,
        "--config.model.moe_ffn_dim=32",
        "--checkpoint",
        str(workdir),
        "--out",
        str(out),
    )
    assert line.endswith("(its config.json): pass --config.model.moe_ffn_dim=48"), line
    assert not out.exists()

    # --out an existing file: before, a FileExistsError.
    (tmp_path / "file").write_text("")
    assert run_export(argv, workdir, tmp_path / "file") == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [f"error: --out {tmp_path / 'file'} is a file; pass a new or empty directory"]


def test_the_quick_start_install_reads_hugging_face_checkpoints():
    """init_from_hf and export need safetensors: requirements.txt (the quick start's) has it."""
    lines = (ROOT / "requirements.txt").read_text().splitlines()
    assert any(line.startswith("safetensors>=") for line in lines)


@hf_reference
@pytest.mark.parametrize("name", ["llama", "mixtral"])
def test_transformers_loads_the_export_with_our_logits(name, trained, tmp_path):
    import torch
    import transformers

    argv, workdir, _ = trained(name)
    out = tmp_path / "hf"
    assert run_export(argv, workdir, out, "--max-shard-size", "64KiB") == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(out).float().eval()
    assert type(model).__name__ == ARCHITECTURES[name]
    with torch.no_grad():
        ref = model(torch.from_numpy(TOKENS.astype(np.int64))).logits.numpy()
    ours = logits(*restored(argv, workdir), TOKENS)
    # float32 both sides; the sums run in other orders (test_interop.py's bound).
    err = np.abs(ours - ref).max() / np.abs(ref).max()
    assert err <= 1e-4, f"max error {err:.2e} of the largest logit"
