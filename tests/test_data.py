"""Token files, `prepare`, the default corpus and the deterministic loader."""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from angel_jax.config import ConfigError, default_config
from angel_jax.data import ByteTokenizer, TokenFile, default_corpus, make_batches
from angel_jax.data.prepare import main as prepare_main
from angel_jax.data.prepare import prepare
from angel_jax.data.tokens import save_token_file
from tests.conftest import hf_reference

REPO = pathlib.Path(__file__).resolve().parents[1]
CLI_ENV = {
    **os.environ,
    "JAX_PLATFORMS": "cpu",
    "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
}
EOS = 256

# Two documents with multi-byte UTF-8, long enough for a few tiny batches.
DOC_A = "def add(a, b):\n    return a + b  # héllo ✓\n" * 30
DOC_B = "Résumé of the plan: train, checkpoint, resume.\n" * 25


def run_module(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", *args],
        cwd=REPO,
        env=CLI_ENV,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def loader_config(path=None, **train):
    config = default_config()
    config.data.path = path
    config.train.update({"batch_size": 4, "seq_len": 8, **train})
    return config


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """Token file written by the prepare CLI from two text files."""
    root = tmp_path_factory.mktemp("prepared")
    (root / "a.txt").write_text(DOC_A, encoding="utf-8")
    (root / "b.txt").write_text(DOC_B, encoding="utf-8")
    out = root / "tokens.npy"
    result = run_module(
        "angel_jax.data.prepare",
        "--out",
        str(out),
        str(root / "a.txt"),
        str(root / "b.txt"),
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return out, result


@pytest.fixture(scope="module")
def small_file(tmp_path_factory):
    """A token file of 20 windows of 8 tokens (+1), ids counting up so windows are recognisable."""
    path = tmp_path_factory.mktemp("small") / "small.npy"
    save_token_file(str(path), (np.arange(20 * 8 + 1) % 251).astype(np.uint16), ByteTokenizer())
    return str(path)


def window_index(tokens: np.ndarray, row: np.ndarray, seq_len: int) -> int:
    """Which window `k` (tokens[k * seq_len : k * seq_len + seq_len + 1]) `row` is; -1 if none."""
    windows = (len(tokens) - 1) // seq_len
    starts = np.asarray(tokens[: windows * seq_len]).reshape(windows, seq_len)
    for k in np.flatnonzero(np.all(starts == row[:seq_len], axis=1)):
        if np.array_equal(tokens[k * seq_len : k * seq_len + seq_len + 1], row):
            return int(k)
    return -1


# --- prepare and token files ---------------------------------------------------------------


def test_prepare_cli_writes_byte_tokens_and_sidecar(prepared):
    out, result = prepared
    expected = list(DOC_A.encode()) + [EOS] + list(DOC_B.encode()) + [EOS]
    tokens = np.load(out)
    assert tokens.dtype == np.uint16
    np.testing.assert_array_equal(tokens, expected)
    meta = json.loads(out.with_suffix(".json").read_text())
    assert meta == dict(tokenizer="byte", vocab_size=257, eos_id=EOS, num_tokens=len(expected))
    assert f"wrote {len(expected)} tokens from 2 documents" in result.stdout


def test_token_file_is_memory_mapped_and_decodes(prepared):
    out, _ = prepared
    data = TokenFile(str(out))
    assert isinstance(data.tokens, np.memmap)
    assert data.vocab_size == 257
    assert data.meta["eos_id"] == EOS
    ends = np.flatnonzero(np.asarray(data.tokens) == EOS)
    np.testing.assert_array_equal(ends, [len(DOC_A.encode()), data.tokens.size - 1])
    tokenizer = ByteTokenizer()
    assert tokenizer.decode(data.tokens[: ends[0]]) == DOC_A
    assert tokenizer.decode(data.tokens[ends[0] + 1 : ends[1]]) == DOC_B


def test_prepare_out_without_npy_suffix(tmp_path):
    (tmp_path / "a.txt").write_text("hello")
    out = tmp_path / "corpus.tokens"
    prepare([str(tmp_path / "a.txt")], str(out))
    assert out.is_file() and not (tmp_path / "corpus.tokens.npy").exists()
    data = TokenFile(str(out))
    np.testing.assert_array_equal(data.tokens, list(b"hello") + [EOS])
    assert data.vocab_size == 257


def test_prepare_missing_input_is_one_line_error(tmp_path, capsys):
    missing = str(tmp_path / "missing.txt")
    assert prepare_main(["--out", str(tmp_path / "x.npy"), missing]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: prepare: input")
    assert missing in err
    assert not (tmp_path / "x.npy").exists()


def test_token_file_without_sidecar_takes_vocab_from_max_id(tmp_path):
    path = tmp_path / "raw.npy"
    np.save(path, np.array([3, 999, 7], np.uint16))
    assert TokenFile(str(path)).vocab_size == 1000


@pytest.mark.parametrize(
    "write, needle",
    [
        (lambda p: p.write_bytes(b"not a numpy file at all"), "not a .npy token array; token"),
        # A text file: numpy's message speaks of pickles, which would mislead.
        (lambda p: p.write_text("notes\n"), "not a .npy token array; token files come from"),
        (lambda p: np.save(p, np.zeros((4, 4), np.uint16)), "expected a 1-D"),
        (lambda p: np.save(p, np.zeros(16, np.float32)), "expected a 1-D"),
        (lambda p: np.save(p, np.zeros(0, np.uint16)), "empty"),
    ],
    ids=["garbage", "text", "2d", "float", "empty"],
)
def test_bad_token_file_is_config_error(tmp_path, write, needle):
    path = tmp_path / "bad.npy"
    write(path)
    with pytest.raises(ConfigError) as e:
        TokenFile(str(path))
    assert str(e.value).startswith(f"config.data.path={path}: ")
    assert needle in str(e.value) and "pickle" not in str(e.value)


def test_empty_token_file_setting_is_config_error():
    with pytest.raises(ConfigError, match="config.data.path is empty: give a token file"):
        TokenFile("")


def test_missing_token_file_names_the_setting_and_the_fix():
    with pytest.raises(ConfigError) as e:
        TokenFile("/nonexistent.npy")
    assert str(e.value).startswith("config.data.path=/nonexistent.npy: no such token file")
    assert "python -m angel_jax.data.prepare" in str(e.value)


@hf_reference  # `tokenizers` comes with transformers (the Python 3.11 environment).
def test_hf_tokenizer(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "</s>": 3}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "a.txt").write_text("hello world")
    (tmp_path / "b.txt").write_text("world hello moon")
    out = tmp_path / "hf.npy"
    info = prepare(
        [str(tmp_path / "a.txt"), str(tmp_path / "b.txt")],
        str(out),
        str(tmp_path / "tokenizer.json"),
    )
    assert info["vocab_size"] == 4
    data = TokenFile(str(out))
    np.testing.assert_array_equal(data.tokens, [1, 2, 3, 2, 1, 0, 3])
    assert data.meta["eos_id"] == 3 and data.vocab_size == 4

    # Without a known end-of-document token, a new id past the vocabulary ends documents.
    del vocab["</s>"]
    tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]")).save(
        str(tmp_path / "no_eos.json")
    )
    prepare([str(tmp_path / "a.txt")], str(out), str(tmp_path / "no_eos.json"))
    data = TokenFile(str(out))
    assert data.meta["eos_id"] == 3 and data.vocab_size == 4
    np.testing.assert_array_equal(data.tokens[-1], 3)

    (tmp_path / "broken.json").write_text("{}")
    with pytest.raises(ConfigError) as e:
        prepare([str(tmp_path / "a.txt")], str(out), str(tmp_path / "broken.json"))
    assert str(e.value).startswith(f"--tokenizer {tmp_path / 'broken.json'}: not a Hugging Face")


# --- default corpus ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def corpus():
    return default_corpus()


def test_default_corpus_is_byte_tokens_of_documents(corpus):
    assert corpus.ndim == 1 and corpus.size > 1_000_000
    assert corpus.dtype == np.uint16
    assert int(corpus.max()) == EOS  # ids < 257, and documents end with eos.
    assert np.count_nonzero(corpus == EOS) > 10
    first = ByteTokenizer().decode(corpus[: np.argmax(corpus == EOS)])
    compile(first, "<first corpus document>", "exec")  # Python sources, as documented.


def test_default_config_reads_windows_of_the_default_corpus(corpus):
    config = loader_config(path=None)
    batch = make_batches(config)[0]
    assert batch.shape == (4, 9) and batch.dtype == np.int32
    for row in batch:
        assert window_index(corpus, row, 8) >= 0


# --- loader --------------------------------------------------------------------------------


def test_batches_are_shuffled_windows_reshuffled_each_epoch(small_file):
    tokens = TokenFile(small_file).tokens
    batches = make_batches(loader_config(small_file))
    # 20 windows, 4 per batch: batches 0-4 are epoch 0, 5-9 epoch 1.
    order = [window_index(tokens, row, 8) for i in range(10) for row in batches[i]]
    assert sorted(order[:20]) == list(range(20))
    assert sorted(order[20:]) == list(range(20))
    assert order[:20] != list(range(20))  # Shuffled...
    assert order[:20] != order[20:]  # ...and differently in each epoch.


def test_batches_identical_across_constructions(small_file):
    a, b = make_batches(loader_config(small_file)), make_batches(loader_config(small_file))
    for i in (0, 3, 17, 10_000):
        np.testing.assert_array_equal(a[i], b[i])
        assert a[i].dtype == np.int32 and a[i].shape == (4, 9)


@pytest.mark.parametrize("prefetch", [0, 3])
@pytest.mark.parametrize("start", [0, 3, 7])
def test_iterate_from_start_matches_random_access(small_file, start, prefetch):
    config = loader_config(small_file)
    config.data.prefetch = prefetch
    batches = make_batches(config)
    it = batches.iterate(start)
    for i in range(start, start + 6):  # Crosses the epoch boundary at batch 5.
        np.testing.assert_array_equal(next(it), batches[i])


def test_different_seeds_give_different_batches(small_file):
    a = make_batches(loader_config(small_file))
    config = loader_config(small_file)
    config.seed = 1
    b = make_batches(config)
    assert not all(np.array_equal(a[i], b[i]) for i in range(5))


def test_synthetic_batches_are_deterministic():
    config = loader_config()
    config.data.synthetic = True
    config.model.vocab_size = 97
    a, b = make_batches(config), make_batches(config)
    for i in (0, 1, 12345):
        np.testing.assert_array_equal(a[i], b[i])
        assert a[i].shape == (4, 9) and a[i].dtype == np.int32
        assert a[i].min() >= 0 and a[i].max() < 97
    assert not np.array_equal(a[0], a[1])
    it = a.iterate(5)
    np.testing.assert_array_equal(next(it), a[5])
    np.testing.assert_array_equal(next(it), a[6])
    config.seed = 1
    assert not np.array_equal(make_batches(config)[0], a[0])


def test_data_path_wins_over_synthetic(small_file):
    # llama_1b sets synthetic=True and documents --config.data.path=... for real data.
    config = loader_config(small_file)
    config.data.synthetic = True
    tokens = TokenFile(small_file).tokens
    for row in make_batches(config)[0]:
        assert window_index(tokens, row, 8) >= 0


def test_too_little_data_names_batch_and_length(small_file):
    with pytest.raises(ConfigError) as e:
        make_batches(loader_config(small_file, batch_size=32))
    message = str(e.value)
    assert message.startswith(f"config.data.path={small_file} holds 161 tokens")
    assert "config.train.batch_size=32" in message and "config.train.seq_len=8" in message


def test_vocab_larger_than_model_is_refused(small_file):
    config = loader_config(small_file)
    config.model.vocab_size = 256
    with pytest.raises(ConfigError) as e:
        make_batches(config)
    assert str(e.value) == (
        f"config.data.path={small_file} has token ids up to 256, but "
        "config.model.vocab_size=256; set config.model.vocab_size >= 257"
    )


# --- training on a prepared file -----------------------------------------------------------


def test_training_on_prepared_token_file(prepared, tmp_path):
    """Two steps on the prepare CLI's file; the checkpoint records where the data stopped."""
    import jax

    from angel_jax.checkpoint import Checkpointer
    from angel_jax.config import load_config
    from angel_jax.mesh import make_mesh
    from angel_jax.train import build

    out, _ = prepared
    overrides = [
        f"--config.data.path={out}",
        "--config.train.steps=2",
        "--config.train.batch_size=8",
        "--config.train.seq_len=16",
        "--config.train.log_every_steps=1",
        "--config.train.tensorboard=false",
        "--config.model.num_layers=1",
        "--config.checkpoint.every_steps=1",
    ]
    workdir = tmp_path / "run"
    result = run_module(
        "angel_jax.launch", "--config", "configs/tiny.py", "--workdir", str(workdir), *overrides
    )
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    for r in records:  # Near ln(512) at initialisation.
        assert 3.0 < r["loss"] < 9.0
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["1", "2"]

    config = load_config(str(REPO / "configs" / "tiny.py"), overrides)
    exp = build(config, make_mesh(config.mesh))
    ckpt = Checkpointer(str(workdir), 1, 3)
    state, data_index = ckpt.restore(2, exp.abstract_state)
    ckpt.close()
    assert int(jax.device_get(state.step)) == 2
    assert data_index == 2
