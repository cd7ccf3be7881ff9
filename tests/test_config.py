"""Config files, `--config.a.b=value` overrides and `validate`."""

import pathlib

import ml_collections
import pytest

from angel_jax.config import ConfigError, apply_overrides, default_config, load_config, validate

REPO = pathlib.Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny.py")


def locked_default() -> ml_collections.ConfigDict:
    config = default_config()
    config.lock()
    return config


def override(*args: str) -> ml_collections.ConfigDict:
    config = locked_default()
    apply_overrides(config, list(args))
    return config


def test_load_config_applies_nested_overrides():
    config = load_config(
        TINY,
        ["--config.train.steps=7", "--config.model.d_model=96", "--config.mesh.tensor=2"],
    )
    assert config.train.steps == 7
    assert config.model.d_model == 96
    assert config.mesh.tensor == 2
    # Settings not overridden keep the config file's values, not the defaults.
    assert config.train.batch_size == 16
    assert config.model.ffn_dim == 384


def test_later_override_wins():
    assert override("--config.train.steps=3", "--config.train.steps=5").train.steps == 5


@pytest.mark.parametrize("path", ["configs/tiny.py", "configs/llama_1b.py", "configs/llama3_8b.py"])
def test_shipped_configs_load_and_validate(path):
    config = load_config(str(REPO / path))
    validate(config)
    assert config.is_locked


def test_loaded_config_is_locked():
    config = load_config(TINY)
    with pytest.raises(AttributeError):
        config.train.stpes = 3


@pytest.mark.parametrize("text", ["true", "True", "TRUE", "1"])
def test_bool_true(text):
    config = override(f"--config.model.tie_embeddings={text}")
    assert config.model.tie_embeddings is True


@pytest.mark.parametrize("text", ["false", "False", "0"])
def test_bool_false(text):
    config = override("--config.model.tie_embeddings=true", f"--config.model.tie_embeddings={text}")
    assert config.model.tie_embeddings is False


@pytest.mark.parametrize("text", ["maybe", "yes", "no"])
def test_bool_rejects_other_words(text):
    with pytest.raises(ConfigError) as e:
        override(f"--config.data.synthetic={text}")
    assert f"--config.data.synthetic={text}" in str(e.value)
    assert "true or false" in str(e.value)


@pytest.mark.parametrize(
    "text, expected", [("12", 12), ("-1", -1), ("1e3", 1000), ("4.0", 4), ("1_000", 1000)]
)
def test_int_parsing(text, expected):
    value = override(f"--config.train.steps={text}").train.steps
    assert value == expected and type(value) is int


@pytest.mark.parametrize("text", ["1.5", "abc", "True", "[1]", "'3'", ""])
def test_int_rejects_non_integers(text):
    with pytest.raises(ConfigError) as e:
        override(f"--config.train.steps={text}")
    message = str(e.value)
    assert message.startswith(f"--config.train.steps={text}: wrong type, expected int")


@pytest.mark.parametrize("text, expected", [("1e-3", 1e-3), ("2", 2.0), ("-0.5", -0.5)])
def test_float_parsing(text, expected):
    value = override(f"--config.train.lr={text}").train.lr
    assert value == expected and type(value) is float


@pytest.mark.parametrize("text", ["fast", "False", "'0.1'", "(1, 2)"])
def test_float_rejects_non_numbers(text):
    with pytest.raises(ConfigError) as e:
        override(f"--config.train.lr={text}")
    assert str(e.value).startswith(f"--config.train.lr={text}: wrong type, expected float")


def test_str_takes_text_verbatim():
    config = override("--config.model.remat=dots", "--config.model.dtype=float32")
    assert config.model.remat == "dots"
    assert config.model.dtype == "float32"


def test_none_typed_str_field_data_path():
    config = locked_default()
    assert config.data.path is None
    assert config.data.get_type("path") is str
    apply_overrides(config, ["--config.data.path=/data/tokens=v2.npy"])
    assert config.data.path == "/data/tokens=v2.npy"  # Only the first '=' splits.
    apply_overrides(config, ["--config.data.path=None"])
    assert config.data.path is None
    # Still a str field after being unset, so it can be set again.
    apply_overrides(config, ["--config.data.path=123"])
    assert config.data.path == "123"


@pytest.mark.parametrize(
    "arg, names",
    [
        ("--config.train.stpes=3", ["--config.train.stpes", "'stpes'", "did you mean steps?"]),
        ("--config.sed=3", ["--config.sed", "'sed'", "did you mean seed?"]),
        ("--config.modle.d_model=3", ["--config.modle.d_model", "'modle'", "did you mean model?"]),
        ("--config.train.zzz=3", ["--config.train.zzz", "'zzz'", "keys of train: b1, b2,"]),
    ],
)
def test_unknown_key_names_the_key(arg, names):
    with pytest.raises(ConfigError) as e:
        override(arg)
    message = str(e.value)
    assert "unknown config key" in message
    for name in names:
        assert name in message


def test_key_below_a_single_value():
    with pytest.raises(ConfigError) as e:
        override("--config.seed.x=1")
    assert str(e.value) == (
        "--config.seed.x: config.seed is a single value, not a group of settings; "
        "set it with --config.seed=VALUE"
    )


def test_group_given_a_value():
    with pytest.raises(ConfigError) as e:
        override("--config.model=3")
    assert "config.model is a group of settings" in str(e.value)
    assert "--config.model.attention=VALUE" in str(e.value)


@pytest.mark.parametrize("arg", ["--config.train.steps", "--steps=3", "train.steps=3"])
def test_malformed_override(arg):
    with pytest.raises(ConfigError) as e:
        override(arg)
    assert str(e.value) == f"{arg}: expected --config.KEY=VALUE"


def test_missing_config_file(tmp_path):
    missing = str(tmp_path / "nope.py")
    with pytest.raises(ConfigError) as e:
        load_config(missing)
    assert str(e.value).startswith(f"--config {missing}: no such file")


def test_config_file_without_get_config(tmp_path):
    file = tmp_path / "empty.py"
    file.write_text("x = 1\n")
    with pytest.raises(ConfigError) as e:
        load_config(str(file))
    assert "defines no get_config()" in str(e.value)


@pytest.mark.parametrize(
    "line, message",
    [
        (
            "c.train.stepz = 5",
            "unknown config key config.train.stepz (did you mean config.train.steps?)",
        ),
        (
            "c.trian = ml_collections.ConfigDict()",
            "unknown config key config.trian (did you mean config.train?)",
        ),
        (
            "c.model.rope_scaling.kindd = 'x'",
            "unknown config key config.model.rope_scaling.kindd "
            "(did you mean config.model.rope_scaling.kind?)",
        ),
    ],
)
def test_a_key_a_config_file_adds_is_an_error_naming_file_key_and_nearest(tmp_path, line, message):
    file = tmp_path / "typo.py"
    file.write_text(
        "import ml_collections\nfrom angel_jax.config import default_config\n\n\n"
        f"def get_config():\n    c = default_config()\n    {line}\n    return c\n"
    )
    with pytest.raises(ConfigError) as e:
        load_config(str(file))
    assert str(e.value) == f"--config {file}: {message}"


def test_config_file_that_is_not_python(tmp_path):
    file = tmp_path / "tiny.cfg"
    file.write_text("def get_config(): pass\n")
    with pytest.raises(ConfigError) as e:
        load_config(str(file))
    assert str(e.value).startswith(f"--config {file}: not a Python file")


def test_validate_accepts_defaults():
    validate(locked_default())


@pytest.mark.parametrize(
    "args, names",
    [
        (["--config.train.microbatches=0"], ["config.train.microbatches=0", "positive"]),
        (["--config.model.head_dim=7"], ["config.model.head_dim=7", "even"]),
        (["--config.seed=-1"], ["config.seed=-1", ">= 0"]),
        (["--config.train.lr=-0.1"], ["config.train.lr=-0.1", "negative"]),
        (["--config.train.optimizer=sgd"], ["config.train.optimizer='sgd'", "adafactor"]),
        (["--config.offload.chunks_in_flight=0"], ["chunks_in_flight=0", ">= 1"]),
        (["--config.offload.cpu_update=1.5"], ["cpu_update=1.5", "in [0, 1]"]),
        (
            ["--config.model.remat=offload_all"],
            ["config.model.remat='offload_all'", "offload_dots"],
        ),
        (
            ["--config.train.batch_size=12", "--config.train.microbatches=5"],
            ["config.train.batch_size=12", "config.train.microbatches=5"],
        ),
        (["--config.train.steps=0"], ["config.train.steps=0"]),
        (["--config.train.seq_len=-4"], ["config.train.seq_len=-4"]),
        (["--config.model.num_layers=0"], ["config.model.num_layers=0"]),
        (
            ["--config.model.num_heads=4", "--config.model.num_kv_heads=3"],
            ["config.model.num_heads=4", "config.model.num_kv_heads=3"],
        ),
        (
            [
                "--config.model.d_model=100",
                "--config.model.num_heads=8",
                "--config.model.num_kv_heads=8",
            ],
            ["config.model.d_model=100", "num_heads=8", "config.model.head_dim"],
        ),
        (["--config.model.head_dim=-8"], ["config.model.head_dim=-8"]),
        (["--config.zero_stage=4"], ["config.zero_stage=4"]),
        (["--config.model.remat=everything"], ["config.model.remat='everything'", "dots"]),
        (["--config.model.attention=flash"], ["config.model.attention='flash'", "cudnn"]),
        (["--config.model.dtype=int8"], ["config.model.dtype='int8'", "bfloat16"]),
        (["--config.model.dtype=None"], ["config.model.dtype=None"]),
        (["--config.data.prefetch=-1"], ["config.data.prefetch=-1"]),
        (["--config.checkpoint.every_steps=-5"], ["config.checkpoint.every_steps=-5"]),
        (["--config.checkpoint.keep=0"], ["config.checkpoint.keep=0", "every_steps=0"]),
    ],
)
def test_validate_names_the_setting(args, names):
    config = override(*args)
    with pytest.raises(ConfigError) as e:
        validate(config)
    message = str(e.value)
    assert "\n" not in message
    for name in names:
        assert name in message


def test_head_dim_allows_d_model_not_divisible_by_heads():
    validate(
        override(
            "--config.model.d_model=100",
            "--config.model.num_heads=8",
            "--config.model.num_kv_heads=8",
            "--config.model.head_dim=16",
        )
    )


def test_a_config_file_that_fails_to_load_is_one_line(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def get_config(:\n")
    with pytest.raises(ConfigError, match=r"loading it failed \(line 1\): SyntaxError") as e:
        load_config(str(bad))
    assert "\n" not in str(e.value)
    raising = tmp_path / "raising.py"
    raising.write_text("def get_config():\n    raise KeyError('x')\n")
    with pytest.raises(ConfigError, match="loading it failed: KeyError"):
        load_config(str(raising))
