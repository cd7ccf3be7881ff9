"""Tokenizes text files into a token file for `config.data.path`.

    python -m angel_jax.data.prepare --out data/corpus.npy notes/*.txt [--tokenizer tokenizer.json]

Each input file is one document. Byte-level tokens by default (vocab 257).
"""

import argparse
import pathlib
import sys

from angel_jax.config import ConfigError
from angel_jax.data.tokens import encode_documents, load_tokenizer, save_token_file


def prepare(inputs: list[str], out: str, tokenizer_path: str | None = None) -> dict:
    tokenizer = load_tokenizer(tokenizer_path)
    texts = []
    for name in inputs:
        path = pathlib.Path(name)
        if not path.is_file():
            raise ConfigError(f"prepare: input {name} does not exist; give text files to tokenize")
        texts.append(path.read_text(encoding="utf-8", errors="replace"))
    tokens = encode_documents(texts, tokenizer)
    try:
        save_token_file(out, tokens, tokenizer)
    except OSError as e:
        raise ConfigError(
            f"prepare: cannot write --out {out} ({e}); choose a writable path"
        ) from None
    return dict(
        out=out, documents=len(texts), tokens=int(tokens.size), vocab_size=tokenizer.vocab_size
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("inputs", nargs="+", help="text files, one document each")
    parser.add_argument("--out", required=True, help="token file to write (.npy)")
    parser.add_argument("--tokenizer", default=None, help="a Hugging Face tokenizer.json")
    args = parser.parse_args(argv)
    try:
        info = prepare(args.inputs, args.out, args.tokenizer)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(
        f"wrote {info['tokens']} tokens from {info['documents']} documents to {info['out']} "
        f"(vocab {info['vocab_size']})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
