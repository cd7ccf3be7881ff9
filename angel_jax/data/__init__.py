"""Token data: tokenizers, token files, the default corpus and the deterministic loader."""

from angel_jax.data.loader import Batches, make_batches
from angel_jax.data.tokens import ByteTokenizer, TokenFile, default_corpus, load_tokenizer

__all__ = [
    "Batches",
    "ByteTokenizer",
    "TokenFile",
    "default_corpus",
    "load_tokenizer",
    "make_batches",
]
