"""Instruction fine-tuning: chat JSONL into a token file and its loss mask (data/chat.py), the
loss on the assistant's tokens only, packed conversations, and the errors."""

import json
import os
import pathlib
import random
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from angel_jax import models
from angel_jax.config import ConfigError, default_config, load_config
from angel_jax.data import TokenFile, make_batches
from angel_jax.data.chat import find_template, prepare_chat
from angel_jax.data.loader import conversation_rows
from angel_jax.data.objectives import causal_rows, make_row_builder, row_fields, split_fields
from angel_jax.data.tokens import END, LOSS, NO_LOSS
from angel_jax.losses import TrainingLoss, objective_loss
from angel_jax.mesh import make_mesh
from angel_jax.models import make_model
from angel_jax.train import build
from tests.conftest import hf_reference

REPO = pathlib.Path(__file__).resolve().parents[1]
EOS = 256  # The byte tokenizer's end of document.
# A small chat template: each turn between its role's tag and <|end|>.
TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CHATS = [
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "reverse: abc"},
            {"role": "assistant", "content": "cba"},
            {"role": "user", "content": "copy: xy"},
            {"role": "assistant", "content": "xy"},
        ]
    },
    {"prompt": "copy: hi", "completion": "hi"},
]


def write_chats(folder: pathlib.Path, chats, name="chat.jsonl") -> tuple[str, str]:
    """(JSONL file, template file) in `folder`."""
    (folder / "chat.jinja").write_text(TEMPLATE)
    (folder / name).write_text("".join(json.dumps(c) + "\n" for c in chats))
    return str(folder / name), str(folder / "chat.jinja")


def prepared(folder: pathlib.Path, chats=CHATS) -> TokenFile:
    jsonl, template = write_chats(folder, chats)
    prepare_chat([jsonl], str(folder / "sft.npy"), template=template)
    return TokenFile(str(folder / "sft.npy"))


def text(ids) -> str:
    return bytes(int(i) for i in ids if i < 256).decode()


def runs(mask, value) -> list[tuple[int, int]]:
    """[start, end) of each run of `value` in `mask`."""
    edges = np.diff(np.concatenate([[0], (np.asarray(mask) == value).astype(int), [0]]))
    return list(zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1), strict=True))


def sft_config(**train):
    c = default_config()
    c.model.update(num_layers=1, d_model=32, num_heads=4, num_kv_heads=2, ffn_dim=64)
    c.model.update(vocab_size=264, dtype="float32")
    c.data.update(packing=True, loss_mask=True)
    c.train.update({"seq_len": 63, "batch_size": 1, **train})
    return c


# --- (a) the prompt carries no loss ----------------------------------------------------------


def test_mask_is_on_the_assistant_tokens_only(tmp_path):
    data = prepared(tmp_path)
    tokens, mask = np.asarray(data.tokens), np.asarray(data.loss_mask)
    assert data.meta["loss_mask"] == "sft.mask.npy"
    assert [text(tokens[a:b]) for a, b in runs(mask, LOSS)] == [
        "cba<|end|>\n",
        "xy<|end|>\n",
        "hi<|end|>\n",
    ]
    # Everything else is the system's and user's turns and the assistant's tags, no loss.
    assert [text(tokens[a:b]) for a, b in runs(mask, NO_LOSS)] == [
        "<|system|>Be brief.<|end|>\n<|user|>reverse: abc<|end|>\n<|assistant|>",
        "<|user|>copy: xy<|end|>\n<|assistant|>",
        "<|user|>copy: hi<|end|>\n<|assistant|>",
    ]
    # Each conversation ends with the end-of-document id, marked END.
    ends = np.flatnonzero(mask == END)
    np.testing.assert_array_equal(ends, np.flatnonzero(tokens == EOS))
    assert ends[-1] == len(tokens) - 1 and len(ends) == 2


@pytest.mark.parametrize("packing", [True, False])
def test_loss_ignores_prompt_targets(tmp_path, packing):
    """A window of the first conversation and the second's prompt: rewriting the prompt's
    tokens (targets, and inputs only after every trained target) leaves the loss as it is;
    rewriting an assistant token does not."""
    data = prepared(tmp_path)
    tokens, mask = np.asarray(data.tokens, np.int32), np.asarray(data.loss_mask, np.int32)
    second = int(np.flatnonzero(mask == END)[0]) + 1  # The second conversation's start.
    c = sft_config()
    c.data.packing = packing
    c.train.seq_len = second + 12 - 1  # Ends 12 tokens into the second conversation's prompt.
    build_rows = make_row_builder(c, 257, EOS)
    model = make_model(c.model, "cpu")[1]
    window = tokens[: c.train.seq_len + 1]
    params = model.init(jax.random.key(0), jnp.asarray(window[None, :-1]))["params"]
    training_loss = TrainingLoss(model, c, 1, lm_head=None, order=None, has_experts=False)
    loss = jax.jit(lambda rows: training_loss(params, rows)[0])  # What the step differentiates.

    def loss_of(window):
        return float(loss(build_rows(np.concatenate([window, mask[: len(window)]])[None], 0, 0)))

    prompt = window.copy()
    prompt[second:] = np.random.default_rng(0).integers(0, 256, len(window) - second)
    answer = window.copy()
    answer[runs(mask, LOSS)[0][0]] = ord("z")
    assert loss_of(prompt) == pytest.approx(loss_of(window), rel=1e-6)
    assert abs(loss_of(answer) - loss_of(window)) > 1e-3


# --- (b) a tiny model learns instructions ----------------------------------------------------


def toy_instructions(n: int, seed: int = 0) -> list[dict]:
    """'reverse: WORD' and 'copy: WORD' over the letters a-h, half of them prompt/completion."""
    rng = random.Random(seed)
    chats = []
    for i in range(n):
        word = "".join(rng.choice("abcdefgh") for _ in range(rng.randint(3, 6)))
        if i % 2:
            chats.append({"prompt": f"reverse: {word}", "completion": word[::-1]})
        else:
            turns = [("user", f"copy: {word}"), ("assistant", word)]
            chats.append({"messages": [{"role": r, "content": t} for r, t in turns]})
    return chats


def test_tiny_model_learns_the_assistant_turns(tmp_path):
    jsonl, template = write_chats(tmp_path, toy_instructions(400))
    out = str(tmp_path / "toy.npy")
    prepare_chat([jsonl], out, template=template)
    overrides = [
        f"--config.data.path={out}",
        "--config.model.dtype=float32",
        "--config.train.seq_len=64",
        "--config.train.lr=3e-3",
        "--config.train.warmup_steps=5",
        "--config.train.steps=40",
    ]
    config = load_config(str(REPO / "configs/llama_sft.py"), overrides)
    models.validate(config)
    exp = build(config, make_mesh(config.mesh))
    state, batches = exp.init_state(), make_batches(config)
    losses = []
    for i in range(config.train.steps):
        state, metrics = exp.train_step(state, exp.global_batch(batches[i]))
        losses.append(float(metrics["loss"]))
    # Above ln(512) at first (about 7); the tags, <|end|> and the letters a-h take it near 1 in
    # 40 steps. The loss counts the assistant's tokens only (about a fifth of a row).
    assert losses[0] > 5.0, losses
    assert np.mean(losses[-5:]) < 0.25 * losses[0], losses
    predicted = float(metrics["predicted_tokens"])
    assert 0.1 * 8 * 64 < predicted < 0.4 * 8 * 64, predicted


# --- (c) packing ----------------------------------------------------------------------------


def test_packed_rows_number_conversations_from_the_mask_ends():
    """Segments restart after each END, not after every end-of-document id: a template may
    write that id inside a conversation (Mistral's </s> after a turn)."""
    tokens = np.array([[5, EOS, 6, 7, EOS, 8, 9, EOS, 4]])
    marks = np.array([[0, LOSS, LOSS, 0, END, 0, LOSS, END, 0]])
    rows = causal_rows(np.concatenate([tokens, marks], axis=1), EOS, True, True)
    c = sft_config(seq_len=8)
    f = split_fields(rows, row_fields(c))
    assert [name for name, _ in row_fields(c)] == ["tokens", "segment_ids", "loss_mask"]
    np.testing.assert_array_equal(f["tokens"], tokens)
    np.testing.assert_array_equal(f["segment_ids"], [[1, 1, 1, 1, 1, 2, 2, 2, 3]])
    np.testing.assert_array_equal(f["loss_mask"], [[0, 1, 1, 0, 0, 0, 1, 0, 0]])


def test_packed_loss_is_each_conversations_alone(tmp_path):
    """The loss of a row of two packed conversations is the mean over their assistant tokens
    of each conversation's loss alone: no attention, positions or loss across the end."""
    data = prepared(tmp_path)
    tokens, mask = np.asarray(data.tokens, np.int32), np.asarray(data.loss_mask, np.int32)
    c = sft_config(seq_len=len(tokens) - 1)
    model = make_model(c.model, "cpu")[1]
    params = model.init(jax.random.key(0), jnp.asarray(tokens[None, :-1]))["params"]
    end = int(np.flatnonzero(mask == END)[0]) + 1
    row = make_row_builder(c, 257, EOS)(np.concatenate([tokens, mask])[None], 0, 0)

    @jax.jit
    def run(params, row):
        packed = objective_loss(model, c, params, row)[0]
        nll = lambda doc: optax.softmax_cross_entropy_with_integer_labels(
            model.apply({"params": params}, doc[None, :-1]), doc[None, 1:]
        )[0]
        return packed, nll(jnp.asarray(tokens[:end])), nll(jnp.asarray(tokens[end:]))

    packed, nll_a, nll_b = run(params, row)
    weights_a, weights_b = mask[1:end] == LOSS, mask[end + 1 :] == LOSS
    expected = (np.sum(nll_a * weights_a) + np.sum(nll_b * weights_b)) / (
        weights_a.sum() + weights_b.sum()
    )
    np.testing.assert_allclose(packed, expected, rtol=2e-5)


def test_packed_rows_hold_whole_conversations_and_cut_only_a_longer_one():
    # Conversations of 2, 2, 7 and 1 tokens (END at each one's last) in rows of 5.
    marks = np.zeros(12, np.int8)
    marks[[1, 3, 10, 11]] = END
    # The long one fills [4, 9) and goes on in [8, 12) (a row's last token is a target only),
    # where the next conversation joins it.
    np.testing.assert_array_equal(conversation_rows(marks, 5), [[0, 4], [4, 9], [8, 12]])


def test_batches_hold_whole_conversations_with_their_mask_and_resume_at_any_index(tmp_path):
    jsonl, template = write_chats(tmp_path, toy_instructions(60))
    out = str(tmp_path / "toy.npy")
    prepare_chat([jsonl], out, template=template)
    data = TokenFile(out)
    tokens, marks = np.asarray(data.tokens), np.asarray(data.loss_mask)
    c = sft_config(seq_len=128, batch_size=4)
    c.data.path = out
    batches = make_batches(c)
    rows = batches[3]
    f = split_fields(rows, row_fields(c))
    padded = lambda a, fill: np.concatenate([a, np.full(129 - len(a), fill)])
    spans = conversation_rows(marks, 129)
    for row, segments, trained in zip(f["tokens"], f["segment_ids"], f["loss_mask"], strict=True):
        s, e = next(
            (s, e) for s, e in spans.tolist() if np.array_equal(padded(tokens[s:e], EOS), row)
        )
        np.testing.assert_array_equal(trained, padded(marks[s:e] == LOSS, 0))
        # Each conversation whole: from its template's first tag to its end-of-document id.
        for k in np.unique(segments[: e - s]):
            conversation = row[: e - s][segments[: e - s] == k]
            assert text(conversation).startswith("<|") and conversation[-1] == EOS, k
    # Batch i depends on i alone: a resumed loader reads the same rows.
    np.testing.assert_array_equal(rows, make_batches(c)[3])
    np.testing.assert_array_equal(next(make_batches(c).iterate(3)), rows)


# --- (d) errors -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "lines, message",
    [
        ([json.dumps(CHATS[1]), "{not json"], r"chat.jsonl:2: not valid JSON \("),
        (['{"messages": []}'], "chat.jsonl:1: the messages must be a non-empty list"),
        (['{"text": "hello"}'], r'chat.jsonl:1: a line needs "messages" .* has \[\'text\'\]'),
        (['{"messages": [{"role": "user", "content": "hi"}]}'], "chat.jsonl:1: .*no assistant"),
        (['{"messages": "hi"}'], "chat.jsonl:1: the messages must be a non-empty list"),
    ],
)
def test_bad_lines_are_one_line_errors_with_the_line_number(tmp_path, lines, message):
    _, template = write_chats(tmp_path, [])
    (tmp_path / "chat.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError, match=message) as e:
        prepare_chat([str(tmp_path / "chat.jsonl")], str(tmp_path / "o.npy"), template=template)
    assert "\n" not in str(e.value)


def test_missing_jsonl_and_missing_template_name_the_fix(tmp_path):
    with pytest.raises(ConfigError, match=r"--jsonl /nonexistent.jsonl: no such file"):
        prepare_chat(["/nonexistent.jsonl"], str(tmp_path / "o.npy"))
    jsonl, _ = write_chats(tmp_path, CHATS)
    with pytest.raises(ConfigError, match="the byte tokenizer has no chat template.*--chat-temp"):
        prepare_chat([jsonl], str(tmp_path / "o.npy"))
    # A tokenizer directory whose tokenizer_config.json has none.
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "</s>"}')
    with pytest.raises(ConfigError) as e:
        find_template(str(tmp_path), None)
    assert str(e.value) == (
        f"prepare --jsonl: the tokenizer at {tmp_path} has no chat template (no "
        "chat_template.jinja, no chat_template in tokenizer_config.json); pass a template with "
        "--chat-template FILE.jinja"
    )


def test_template_is_found_as_transformers_finds_it(tmp_path):
    """tokenizer_config.json's template (the default of a list), chat_template.jinja before it,
    --chat-template before both; special tokens from both files, AddedTokens as their text."""
    (tmp_path / "special_tokens_map.json").write_text('{"bos_token": {"content": "<s>"}}')
    templates = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    config = {"chat_template": templates, "eos_token": "</s>", "add_bos_token": True}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    special = {"bos_token": "<s>", "eos_token": "</s>"}
    assert find_template(str(tmp_path / "tokenizer.json"), None) == ("D", special)
    (tmp_path / "chat_template.jinja").write_text("J")
    assert find_template(str(tmp_path), None) == ("J", special)
    (tmp_path / "mine.jinja").write_text("M")
    assert find_template(str(tmp_path), str(tmp_path / "mine.jinja")) == ("M", special)


def test_prepare_cli_prints_one_line_error(tmp_path):
    jsonl, _ = write_chats(tmp_path, CHATS)
    done = subprocess.run(
        [sys.executable, "-m", "angel_jax.data.prepare", "--jsonl", jsonl, "--out", "o.npy"],
        cwd=REPO,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr.startswith("error: prepare --jsonl: the byte tokenizer has no chat")
    assert done.stderr.count("\n") == 1


def test_loss_mask_settings_fit_the_data(tmp_path):
    data = prepared(tmp_path)
    c = sft_config(seq_len=8)
    c.data.path = str(tmp_path / "sft.npy")
    c.data.loss_mask = False
    with pytest.raises(ConfigError, match="is chat data .*set config.data.loss_mask=true"):
        make_batches(c)
    text_file = tmp_path / "text.npy"
    np.save(text_file, np.asarray(data.tokens))
    c.data.path, c.data.loss_mask = str(text_file), True
    with pytest.raises(ConfigError, match="has no loss mask; make the token file from chat"):
        make_batches(c)
    c.data.path = None
    with pytest.raises(ConfigError, match="config.data.loss_mask .* needs the causal objective"):
        models.validate(c)
    c.data.path, c.data.packing, c.mesh.pipeline = str(text_file), False, 2
    with pytest.raises(ConfigError, match="config.data.loss_mask: the pipeline .*loss_mask=false"):
        models.validate(c)


# --- Hugging Face tokenizers -----------------------------------------------------------------


@hf_reference  # `tokenizers` comes with transformers (the Python 3.11 environment).
def test_hf_tokenizer_directory_matches_apply_chat_template(tmp_path):
    """A tokenizer directory (tokenizer.json + tokenizer_config.json with a chat template):
    the token ids are apply_chat_template's, the mask its assistant mask ({% generation %}),
    and the </s> its template writes after every turn does not split a conversation."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    words = "<s> </s> [UNK] <|user|> <|assistant|> <|system|> hi hello there reverse abc cba"
    vocab = {w: i for i, w in enumerate(words.split())}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    template = (
        "{{ bos_token }}{% for m in messages %}{% if m.role == 'assistant' %}<|assistant|> "
        "{% generation %}{{ m.content }} {{ eos_token }}{% endgeneration %} {% else %}"
        "<|{{ m.role }}|> {{ m.content }} {{ eos_token }} {% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|> {% endif %}"
    )
    config = dict(
        bos_token="<s>",
        eos_token="</s>",
        unk_token="[UNK]",
        chat_template=template,
        tokenizer_class="PreTrainedTokenizerFast",
    )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    chats = [
        {
            "messages": [
                {"role": "system", "content": "hi"},
                {"role": "user", "content": "reverse abc"},
                {"role": "assistant", "content": "cba"},
                {"role": "user", "content": "hello"},
                {"role": "assistant", "content": "hello there"},
            ]
        },
        {"prompt": "hi", "completion": "hello"},
    ]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    info = prepare_chat([str(tmp_path / "chat.jsonl")], str(tmp_path / "o.npy"), str(tmp_path))
    data = TokenFile(str(tmp_path / "o.npy"))
    assert info["vocab_size"] == len(vocab) and data.meta["eos_id"] == vocab["</s>"]
    assert data.meta["tokenizer"] == str(tmp_path / "tokenizer.json")

    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    expected_ids, expected_mask = [], []
    for chat in chats:
        messages = chat.get("messages") or [
            {"role": "user", "content": chat["prompt"]},
            {"role": "assistant", "content": chat["completion"]},
        ]
        out = hf.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        expected_ids += [*out["input_ids"], vocab["</s>"]]
        expected_mask += [*out["assistant_masks"], END]
    np.testing.assert_array_equal(data.tokens, expected_ids)
    np.testing.assert_array_equal(data.loss_mask, expected_mask)

    # Packed, each conversation is one segment although </s> ends each of its turns.
    c = sft_config(seq_len=len(expected_ids) - 1)
    rows = make_row_builder(c, len(vocab), vocab["</s>"])(
        np.concatenate([data.tokens, data.loss_mask]).astype(np.int32)[None], 0, 0
    )
    segments = split_fields(rows, row_fields(c))["segment_ids"][0]
    first = int(np.flatnonzero(np.asarray(expected_mask) == END)[0]) + 1
    assert set(segments[:first]) == {1} and set(segments[first:]) == {2}
