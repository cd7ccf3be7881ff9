"""Tokenizes text files, or chat data, into a token file for `config.data.path`.

    python -m angel_jax.data.prepare --out data/corpus.npy notes/*.txt [--tokenizer tokenizer.json]
    python -m angel_jax.data.prepare --out data/sft.npy --jsonl chat.jsonl --tokenizer CKPT_DIR

Each text file is one document; each JSONL line one conversation, with a loss mask on the
assistant's tokens (data/chat.py). Byte-level tokens by default (vocab 257).
"""

import argparse
import pathlib
import sys

from angel_jax.config import ConfigError
from angel_jax.data.chat import prepare_chat
from angel_jax.data.tokens import encode_documents, load_tokenizer, save_token_file

BINARY_SHARE = 0.01  # Undecodable or zero bytes beyond this share: not a text file.


def prepare(inputs: list[str], out: str, tokenizer_path: str | None = None) -> dict:
    tokenizer = load_tokenizer(tokenizer_path)
    texts = []
    for name in inputs:
        path = pathlib.Path(name)
        if path.is_dir():
            raise ConfigError(
                f"prepare: input {name} is a directory; give its text files (e.g. {name}/*.txt)"
            )
        if not path.is_file():
            raise ConfigError(f"prepare: input {name} does not exist; give text files to tokenize")
        raw = path.read_bytes()
        text = raw.decode("utf-8", errors="replace")
        # Tokenized anyway, a binary file is noise the model learns: refuse it by name.
        if raw and text.count("\ufffd") + raw.count(0) > BINARY_SHARE * len(raw):
            raise ConfigError(
                f"prepare: input {name} is not text (over {BINARY_SHARE:.0%} of its bytes are "
                "not UTF-8 or are zero); give text files"
            )
        texts.append(text)
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
    parser.add_argument("inputs", nargs="*", help="text files, one document each")
    parser.add_argument("--out", required=True, help="token file to write (.npy)")
    parser.add_argument(
        "--tokenizer", default=None, help="a Hugging Face tokenizer.json, or its directory"
    )
    parser.add_argument(
        "--jsonl",
        action="append",
        help="a JSONL file of conversations (repeat for more), in place of text files",
    )
    parser.add_argument(
        "--chat-template", default=None, help="a Jinja chat template, in place of the tokenizer's"
    )
    args = parser.parse_args(argv)
    if bool(args.inputs) == bool(args.jsonl):
        parser.error("give text files or --jsonl files (one of them)")
    if args.chat_template and not args.jsonl:
        parser.error("--chat-template renders --jsonl conversations; give --jsonl files")
    try:
        if args.jsonl:
            info = prepare_chat(args.jsonl, args.out, args.tokenizer, args.chat_template)
        else:
            info = prepare(args.inputs, args.out, args.tokenizer)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.jsonl:
        print(
            f"wrote {info['tokens']} tokens from {info['documents']} conversations to "
            f"{info['out']} (vocab {info['vocab_size']}; loss on {info['trained']} of them)"
        )
    else:
        print(
            f"wrote {info['tokens']} tokens from {info['documents']} documents to {info['out']} "
            f"(vocab {info['vocab_size']})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
