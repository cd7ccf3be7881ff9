"""The generator's command line: one warning past the length the model was trained at, one
`error:` line where the tokenizer cannot decode the model's ids, and hints for other tools'
flags and for settings given words they do not take."""

import json
import pathlib

import pytest

from angel_jax import generate
from angel_jax.cli import Parser
from tests.test_generate import random_params

TINY = str(pathlib.Path(__file__).resolve().parents[1] / "configs" / "tiny.py")


def generate_cli(monkeypatch, capsys, *args: str, params=random_params) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of generate's command line on configs/tiny.py (1 layer,
    vocabulary 512) with `params(exp)`, random by default."""
    monkeypatch.setattr(generate, "load_params_for", lambda exp, checkpoint: params(exp))
    status = generate.main(["--config", TINY, "--config.model.num_layers=1", *args])
    out, err = capsys.readouterr()
    return status, out, err


def test_warns_once_past_the_trained_length(monkeypatch, capsys):
    prompt = ("--prompt-tokens", "72,105", "--steps", "4")  # 6 positions.
    status, out, err = generate_cli(monkeypatch, capsys, "--config.train.seq_len=6", *prompt)
    assert status == 0 and len(out.split(",")) == 6 and err == ""
    status, out, err = generate_cli(monkeypatch, capsys, "--config.train.seq_len=5", *prompt)
    assert status == 0 and len(out.split(",")) == 6
    assert err.startswith("warning: 2 prompt tokens + 4 steps = 6 positions, past the 5 ")
    assert "config.train.seq_len=5" in err and err.count("\n") == 1


def one_error_line(err: str) -> str:
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


@pytest.mark.parametrize("data", ["synthetic", "token file", "hf without tokenizer"])
def test_refuses_a_tokenizer_smaller_than_what_the_model_learned(
    monkeypatch, capsys, tmp_path, data
):
    overrides = {
        "synthetic": ["--config.data.synthetic=true"],  # Random ids over all 512.
        "token file": [f"--config.data.path={tmp_path / 'tokens.npy'}"],
        "hf without tokenizer": [f"--config.init_from_hf={tmp_path}"],
    }[data]
    meta = dict(tokenizer="gpt2/tokenizer.json", vocab_size=50257, eos_id=50256)
    (tmp_path / "tokens.json").write_text(json.dumps(meta))  # The token file's sidecar.

    def unloaded(exp):
        raise AssertionError("refused only after loading the weights")

    status, out, err = generate_cli(
        monkeypatch, capsys, *overrides, "--prompt", "Hi", params=unloaded
    )
    assert status == 2 and out == ""
    assert "--tokenizer FILE" in one_error_line(err) and "--prompt-tokens IDS" in err
    if data == "token file":
        assert "ids 0..50256 (config.data.path's tokenizer, gpt2/tokenizer.json)" in err


def test_refuses_generated_ids_the_tokenizer_cannot_decode(monkeypatch, capsys):
    # Random weights over 512 ids: the byte tokenizer decodes 0..256 and dropped the rest.
    status, out, err = generate_cli(monkeypatch, capsys, "--prompt", "Hi", "--steps", "4")
    assert status == 2 and out == ""
    assert "generated ids 455, 487, 497 that the tokenizer byte cannot" in one_error_line(err)
    assert "--prompt-tokens IDS" in err


def test_other_tools_flags_point_to_ours(capsys):
    with pytest.raises(SystemExit) as e:  # difflib alone said --prompt-tokens.
        generate.main(["--config", TINY, "--prompt", "Hi", "--max-new-tokens", "5"])
    assert e.value.code == 2
    assert "unknown flag --max-new-tokens; did you mean --steps?" in capsys.readouterr().err
    parser = Parser()  # A hint names only a flag the parser has.
    parser.add_argument("--workdir")
    for flag, hint in (("--output_dir", "; did you mean --workdir?"), ("--max_new_tokens", " (")):
        with pytest.raises(SystemExit):
            parser.parse_known_args([flag, "5"])
        assert f"unknown flag {flag}{hint}" in capsys.readouterr().err


def test_a_bool_setting_refuses_other_words(monkeypatch, capsys):
    status, _, err = generate_cli(
        monkeypatch, capsys, "--config.model.sequence_parallel=yes", "--prompt-tokens", "1"
    )
    assert status == 2
    assert "--config.model.sequence_parallel=yes" in one_error_line(err)
    assert "true or false" in err
