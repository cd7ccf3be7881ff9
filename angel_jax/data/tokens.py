"""Tokenizers and the token-file format.

A token file is a 1-D `.npy` array (uint16 or uint32, memory-mapped when read) of documents
joined by the tokenizer's end-of-document id, with a `.json` sidecar naming the tokenizer and its
vocabulary size so a model too small for the data is refused before training. Chat data
(data/chat.py) adds a loss mask, `FILE.mask.npy`: a uint8 per token, one of the values below.
"""

import json
import pathlib
import sys
import sysconfig

import numpy as np

from angel_jax.config import ConfigError

# Loss mask values. END marks the end-of-document token after each conversation, which alone
# ends a packed document: a chat template may write that token inside a conversation too
# (Mistral's and Zephyr's </s> after each turn).
NO_LOSS, LOSS, END = 0, 1, 2


class ByteTokenizer:
    """Bytes 0..255 are their own ids; 256 ends a document."""

    name = "byte"
    vocab_size = 257
    eos_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A local Hugging Face `tokenizer.json`, or a directory holding one (needs the
    `tokenizers` package)."""

    def __init__(self, path: str):
        file = pathlib.Path(path)
        if file.is_dir():
            file = file / "tokenizer.json"
        if not file.is_file():  # Before the package: the file is the cause.
            raise ConfigError(
                f"--tokenizer {path}: no such file; give a tokenizer.json or its directory"
            )
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ConfigError(
                f"--tokenizer {path}: needs the 'tokenizers' package; pip install tokenizers"
            ) from None
        try:
            self._tok = Tokenizer.from_file(str(file))
        except Exception as e:  # tokenizers raises its own error types for bad files.
            raise ConfigError(
                f"--tokenizer {path}: not a Hugging Face tokenizer.json ({e}); give the "
                "tokenizer.json of a trained tokenizer"
            ) from None
        self.name = str(file)  # The file itself: export copies it beside the weights.
        self.vocab_size = self._tok.get_vocab_size()
        eos = next(
            (
                self._tok.token_to_id(t)
                for t in ("</s>", "<|endoftext|>", "<|end_of_text|>", "[SEP]")
                if self._tok.token_to_id(t) is not None
            ),
            None,
        )
        self.eos_id = eos if eos is not None else self.vocab_size
        self.vocab_size = max(self.vocab_size, self.eos_id + 1)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])


def load_tokenizer(path: str | None):
    return ByteTokenizer() if path is None else HFTokenizer(path)


def encode_documents(texts, tokenizer) -> np.ndarray:
    ids = []
    for text in texts:
        ids.extend(tokenizer.encode(text))
        ids.append(tokenizer.eos_id)
    dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32
    return np.asarray(ids, dtype=dtype)


class TokenFile:
    """A memory-mapped token file and its metadata."""

    def __init__(self, path: str):
        if not path:
            raise ConfigError(
                "config.data.path is empty: give a token file made by "
                "`python -m angel_jax.data.prepare`, or leave it unset for the default corpus"
            )
        file = pathlib.Path(path)
        meta_file = file.with_suffix(".json")
        if file.is_dir():
            raise ConfigError(
                f"config.data.path={path} is a directory; give its token file (.npy), made by "
                "`python -m angel_jax.data.prepare --out FILE.npy TEXT_FILES...`"
            )
        if not file.is_file():
            raise ConfigError(
                f"config.data.path={path}: no such token file; create one with "
                "`python -m angel_jax.data.prepare --out FILE.npy TEXT_FILES...` "
                "or leave config.data.path unset for the default corpus"
            )
        try:
            self.tokens = np.load(file, mmap_mode="r")
            self.meta = json.loads(meta_file.read_text()) if meta_file.is_file() else {}
        except (ValueError, OSError, EOFError, json.JSONDecodeError) as e:  # EOF: 0 bytes.
            # numpy's own text (about pickles for a text file) would mislead: name the kind.
            what = (
                f"{meta_file.name} is not JSON"
                if isinstance(e, json.JSONDecodeError)
                else ("not a .npy token array")
            )
            raise ConfigError(
                f"config.data.path={path}: {what}; token files come from "
                "`python -m angel_jax.data.prepare --out FILE.npy TEXT_FILES...`"
            ) from None
        if self.tokens.ndim != 1 or self.tokens.dtype not in (np.uint16, np.uint32, np.int32):
            raise ConfigError(
                f"config.data.path={path}: expected a 1-D uint16/uint32 array, got "
                f"{self.tokens.dtype} of shape {self.tokens.shape}; re-create it with prepare"
            )
        if self.tokens.size == 0:
            raise ConfigError(
                f"config.data.path={path}: the token file is empty; re-create it from non-empty "
                "text files with prepare"
            )
        self.vocab_size = int(self.meta.get("vocab_size", int(self.tokens.max()) + 1))
        self.loss_mask = None  # Chat data's (NO_LOSS, LOSS, END per token), memory-mapped.
        if self.meta.get("loss_mask"):
            mask_file = file.with_name(self.meta["loss_mask"])
            try:
                self.loss_mask = np.load(mask_file, mmap_mode="r")
            except (ValueError, OSError, EOFError):
                self.loss_mask = None
            if self.loss_mask is None or self.loss_mask.shape != self.tokens.shape:
                raise ConfigError(
                    f"config.data.path={path}: its loss mask {mask_file.name} is missing or not "
                    f"one value per token; re-create both with `python -m angel_jax.data.prepare "
                    "--jsonl`"
                )


def save_token_file(path: str, tokens: np.ndarray, tokenizer, loss_mask=None) -> None:
    """Writes the tokens, their sidecar and, for chat data, the loss mask (`FILE.mask.npy`)."""
    file = pathlib.Path(path)
    file.parent.mkdir(parents=True, exist_ok=True)
    with open(file, "wb") as f:  # np.save(path) would add ".npy" to a name without it.
        np.save(f, tokens)
    meta = dict(
        tokenizer=tokenizer.name,
        vocab_size=tokenizer.vocab_size,
        eos_id=tokenizer.eos_id,
        num_tokens=int(tokens.size),
    )
    if loss_mask is not None:
        mask_file = file.with_suffix(".mask.npy")
        with open(mask_file, "wb") as f:
            np.save(f, np.asarray(loss_mask, np.uint8))
        meta["loss_mask"] = mask_file.name  # Beside the token file.
    file.with_suffix(".json").write_text(json.dumps(meta, indent=1))


def default_corpus(max_bytes: int = 16 * 2**20) -> np.ndarray:
    """Byte tokens of the Python standard library's own source, which every install ships.

    Files are taken in sorted order, so the corpus is the same on every run of one Python
    version (it differs between versions, as their sources do).
    """
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    if not files:
        raise ConfigError(
            f"the default corpus needs Python's standard library sources under {root}, which "
            f"this Python ({sys.executable}) lacks; set config.data.path to a token file"
        )
    texts, size = [], 0
    for f in files:
        text = f.read_text(encoding="utf-8", errors="replace")
        texts.append(text)
        size += len(text)
        if size >= max_bytes:
            break
    return encode_documents(texts, ByteTokenizer())
