"""`pip install .`: the wheel holds the package, the shipped configs and the console scripts, and
`--config NAME` finds those configs from any working directory (angel_jax/config.py)."""

import configparser
import importlib.util
import json
import os
import pathlib
import shutil
import site
import subprocess
import sys
import sysconfig
import zipfile

import pytest

from angel_jax.config import ConfigError, load_config

REPO = pathlib.Path(__file__).resolve().parents[1]
# What `pip wheel .` reads from the checkout.
BUILD_INPUTS = ("pyproject.toml", "requirements.txt", "angel_jax", "kernels_pallas", "configs")
SCRIPTS = {
    "angel-jax-train": "angel_jax.launch:main",
    "angel-jax-generate": "angel_jax.generate:main",
    "angel-jax-export": "angel_jax.export:main",
    "angel-jax-prepare": "angel_jax.data.prepare:main",
    "angel-jax-supervise": "angel_jax.supervise:main",
}
# As tests/test_errors.py's SMALL: a run that compiles quickly.
SMALL = [
    "--config.train.steps=2",
    "--config.train.batch_size=8",
    "--config.train.seq_len=16",
    "--config.train.tensorboard=false",
    "--config.model.num_layers=1",
    "--config.checkpoint.every_steps=0",
    "--config.data.synthetic=true",
]


def build_wheel(tmp: pathlib.Path) -> pathlib.Path:
    """`pip wheel .` of a copy of the checkout: pip builds in the source tree (build/,
    *.egg-info), which the copy keeps out of the checkout and apart from parallel runs."""
    source = tmp / "source"
    source.mkdir()
    for name in BUILD_INPUTS:
        if (REPO / name).is_dir():
            ignore = shutil.ignore_patterns("__pycache__")
            shutil.copytree(REPO / name, source / name, ignore=ignore)
        else:
            shutil.copy(REPO / name, source / name)
    pip = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
    subprocess.run([*pip, "-w", str(tmp / "dist"), str(source)], check=True, capture_output=True)
    (wheel,) = (tmp / "dist").glob("*.whl")
    return wheel


def install(wheel: pathlib.Path, root: pathlib.Path) -> pathlib.Path:
    """A virtual environment at `root` with the wheel installed; this one's packages (jax and
    the rest) are seen behind it, so nothing is downloaded. Returns its bin/ folder."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    purelib = pathlib.Path(sysconfig.get_path("purelib", "venv", {"base": str(root)}))
    lines = [f"import site; site.addsitedir({p!r})\n" for p in site.getsitepackages()]
    (purelib / "_angel_jax_test_parent.pth").write_text("".join(lines))
    python = root / "bin" / "python"
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps"]
    subprocess.run([*pip, "--no-index", str(wheel)], check=True, capture_output=True)
    return root / "bin"


def test_pip_install_gives_the_console_scripts_and_the_shipped_configs(tmp_path):
    if importlib.util.find_spec("setuptools") is None:
        pytest.skip("the wheel is built with setuptools (requirements-dev.txt), not installed")
    wheel = build_wheel(tmp_path)
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = [p for d in ("angel_jax", "kernels_pallas") for p in (REPO / d).rglob("*.py")]
    expected = {p.relative_to(REPO).as_posix() for p in modules}
    expected |= {f"angel_jax/configs/{p.name}" for p in (REPO / "configs").glob("*.py")}
    assert "angel_jax/configs/tiny.py" in expected
    assert not expected - names, "pyproject.toml's packages miss these"
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    parser = configparser.ConfigParser()
    parser.read_string(zipfile.ZipFile(wheel).read(entry_points).decode())
    assert dict(parser["console_scripts"]) == SCRIPTS

    bin_dir = install(wheel, tmp_path / "venv")
    cwd = tmp_path / "elsewhere"  # Neither the checkout nor a folder with configs/ in it.
    cwd.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    where = (
        "from angel_jax.config import find_config, load_config; "
        "print(find_config('tiny')); print(find_config('configs/moe_1b.py')); "
        "print(load_config('moe_1b').model.num_experts)"
    )
    commands = {name: [str(bin_dir / name), "--help"] for name in SCRIPTS}
    commands["where"] = [str(bin_dir / "python"), "-c", where]
    train = [str(bin_dir / "angel-jax-train"), "--config", "tiny", "--workdir", "run", *SMALL]
    commands["train"] = train
    runs = {
        name: subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, text=True)
        for name, command in commands.items()
    }
    out = {name: run.communicate(timeout=300)[0] for name, run in runs.items()}
    assert {name: run.returncode for name, run in runs.items()} == dict.fromkeys(commands, 0)
    for name in SCRIPTS:
        assert out[name].startswith(f"usage: {name} "), out[name]
    configs = (tmp_path / "venv" / "lib").resolve()  # The installed copies, not the checkout's.
    tiny, moe, experts = out["where"].split()
    assert pathlib.Path(tiny).is_relative_to(configs) and tiny.endswith("configs/tiny.py")
    assert pathlib.Path(moe).is_relative_to(configs) and experts == "16"  # Read llama_1b beside.
    lines = (cwd / "run" / "metrics.jsonl").read_text().splitlines()
    assert json.loads(lines[-1])["step"] == 2
    assert json.loads((cwd / "run" / "config.json").read_text())["model"]["d_model"] == 128


@pytest.mark.parametrize("arg", ["tiny", "tiny.py", "configs/tiny.py"])
def test_a_shipped_config_by_name_from_any_directory(arg, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    expected = load_config(str(REPO / "configs" / "tiny.py"), ["--config.train.steps=3"])
    assert load_config(arg, ["--config.train.steps=3"]).to_dict() == expected.to_dict()


def test_a_file_that_exists_wins_over_the_shipped_config(tmp_path, monkeypatch):
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "tiny.py").write_text(
        "from angel_jax.config import default_config\n\n"
        "def get_config():\n    c = default_config()\n    c.train.steps = 7\n    return c\n"
    )
    monkeypatch.chdir(tmp_path)
    assert load_config("configs/tiny.py").train.steps == 7
    assert load_config("tiny").train.steps == 200  # No ./tiny: the shipped one.


@pytest.mark.parametrize("arg", ["tinyy", "configs/tinyy.py", "{tmp}/tiny.py"])
def test_an_unknown_config_names_the_shipped_ones(arg, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    arg = arg.format(tmp=tmp_path)  # A path with a folder is never taken for a name.
    with pytest.raises(ConfigError) as e:
        load_config(arg)
    message = str(e.value)
    assert message.startswith(f"--config {arg}: no such file or shipped config")
    assert "\n" not in message
    assert message.endswith(", tiny") and "llama_1b, llama_finetune," in message
