"""Chat and instruction data: JSONL conversations rendered with the tokenizer's chat template
into a token file and its loss mask, so fine-tuning learns the assistant's turns only.

    python -m angel_jax.data.prepare --jsonl chat.jsonl --tokenizer CHECKPOINT_DIR --out sft.npy

Each line is {"messages": [{"role": ..., "content": ...}, ...]}, or {"prompt": ...,
"completion": ...}: a user turn and the assistant's answer (each may also be a list of
messages). The template is the one transformers' `apply_chat_template` uses (chat_template.jinja
beside the tokenizer, else tokenizer_config.json's `chat_template`; --chat-template FILE wins),
rendered the same way: jinja2's sandbox, with the tokenizer's special tokens.
"""

import datetime
import json
import pathlib

import numpy as np

from angel_jax.config import ConfigError
from angel_jax.data.tokens import END, LOSS, load_tokenizer, save_token_file

FIX = "pass a template with --chat-template FILE.jinja"


def read_conversations(path: str):
    """(where, messages) of each line of a JSONL file; `where` is FILE:LINE."""
    file = pathlib.Path(path)
    if not file.is_file():
        raise ConfigError(f"prepare --jsonl {path}: no such file; give a JSONL file of chats")
    with open(file, "rb") as f:
        for number, raw in enumerate(f, 1):
            where = f"{path}:{number}"
            try:
                record = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError:
                raise ConfigError(f"{where}: not UTF-8 text; give a JSONL file") from None
            except json.JSONDecodeError as e:
                if not raw.strip():
                    continue  # Blank lines, as at the end of many files.
                raise ConfigError(
                    f"{where}: not valid JSON ({e.msg}, column {e.colno}); each line holds one "
                    'object with "messages", or "prompt" and "completion"'
                ) from None
            yield where, messages_of(record, where)


def messages_of(record, where: str) -> list[dict]:
    """The conversation of one JSONL record, checked."""
    if isinstance(record, dict) and "messages" in record:
        messages = record["messages"]
    elif isinstance(record, dict) and "prompt" in record and "completion" in record:
        prompt, completion = record["prompt"], record["completion"]
        user = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        answer = completion
        if not isinstance(completion, list):
            answer = [{"role": "assistant", "content": completion}]
        messages = user + answer
    else:
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise ConfigError(
            f'{where}: a line needs "messages" (a list of {{"role", "content"}}) or "prompt" '
            f'and "completion"; this one has {keys or "no keys"}'
        )
    if not (
        isinstance(messages, list)
        and messages
        and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages)
    ):
        raise ConfigError(
            f'{where}: the messages must be a non-empty list of {{"role": ..., "content": ...}}'
        )
    if not any(m["role"] == "assistant" for m in messages):
        raise ConfigError(
            f"{where}: the conversation has no assistant turn, so nothing to learn from it; add "
            "one or drop the line"
        )
    return messages


def find_template(tokenizer_path: str | None, template_path: str | None) -> tuple[str, dict]:
    """(chat template, the special tokens it may name, e.g. bos_token), as transformers finds
    them: chat_template.jinja beside the tokenizer, else tokenizer_config.json's."""
    folder = None
    if tokenizer_path is not None:
        folder = pathlib.Path(tokenizer_path)
        folder = folder if folder.is_dir() else folder.parent
    read = {}  # Older checkpoints keep the special tokens in special_tokens_map.json alone.
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        if folder is not None and (folder / name).is_file():
            try:
                read[name] = json.loads((folder / name).read_text(encoding="utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ConfigError(
                    f"--tokenizer {tokenizer_path}: {name} is not JSON ({e})"
                ) from None
    config = read.get("tokenizer_config.json", {})
    special = {  # Strings, or {"content": ...} as transformers saves an AddedToken.
        key: value.get("content", "") if isinstance(value, dict) else value
        for contents in read.values()
        for key, value in contents.items()
        if key.endswith("_token") and isinstance(value, str | dict)
    }
    if template_path is not None:
        file = pathlib.Path(template_path)
        if not file.is_file():
            raise ConfigError(f"--chat-template {template_path}: no such file; {FIX}")
        return file.read_text(encoding="utf-8"), special
    if folder is not None and (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text(encoding="utf-8"), special
    template = config.get("chat_template")
    if isinstance(template, list):  # Named templates: the default one.
        template = {t.get("name"): t.get("template") for t in template}.get("default")
    if not isinstance(template, str) or not template:
        what = f"the tokenizer at {tokenizer_path}" if tokenizer_path else "the byte tokenizer"
        raise ConfigError(
            f"prepare --jsonl: {what} has no chat template (no chat_template.jinja, no "
            f"chat_template in tokenizer_config.json); {FIX}"
        )
    return template, special


def make_renderer(template: str, special: dict):
    """`render(messages, add_generation_prompt) -> text`: the template compiled as transformers
    compiles it, so the text is what `apply_chat_template` gives."""
    try:
        import jinja2
        import jinja2.ext
        import jinja2.sandbox
    except ImportError:
        raise ConfigError(
            "prepare --jsonl renders chat templates with jinja2; pip install jinja2"
        ) from None

    class Generation(jinja2.ext.Extension):
        """{% generation %}: transformers' mark of the assistant's text; rendered as it is
        (the mask comes from prefixes, see `encode_conversation`)."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_body")
            return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda format: datetime.datetime.now().strftime(format)
    try:
        compiled = env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ConfigError(
            f"the chat template does not parse ({e.message}, line {e.lineno}); {FIX}"
        ) from None

    def render(messages, add_generation_prompt: bool) -> str:
        # tools=None as transformers passes it: templates test `tools is not none`.
        return compiled.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            tools=None,
            documents=None,
            **special,
        )

    return render, jinja2.exceptions.TemplateError


def encode_conversation(messages, render, encode, where: str) -> tuple[list[int], np.ndarray]:
    """(token ids, loss mask: LOSS on the assistant's tokens) of one conversation.

    The assistant's tokens are found from renderings of prefixes of the conversation: turn i
    starts where the turns before it, with the generation prompt, end; it ends where its own
    rendering parts from the whole's (a template may close a rendering with an end token that
    the whole has only at its end). Few templates mark the assistant's text with {% generation
    %} for `return_assistant_tokens_mask` (Llama 3's, Qwen's and Mistral's do not); prefixes
    need no marks, and the ids are those of the whole conversation, as a chat model reads it.
    """
    ids = encode(render(messages, False))
    mask = np.zeros(len(ids), np.uint8)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = encode(render(messages[:i], True))
        if ids[: len(before)] != before:
            raise ConfigError(
                f"{where}: the chat template renders the turns before assistant turn {i + 1} "
                "differently once that turn follows, so its tokens cannot be found; give such "
                f"conversations one assistant turn each, or {FIX}"
            )
        upto = encode(render(messages[: i + 1], False))
        same = [a == b for a, b in zip(upto, ids, strict=False)] + [False]
        end = same.index(False)  # Where the two part.
        mask[len(before) : end] = LOSS
    return ids, mask


def prepare_chat(
    jsonl: list[str], out: str, tokenizer_path: str | None = None, template: str | None = None
) -> dict:
    """Writes the token file and loss mask of the conversations in `jsonl` (see module doc):
    each conversation, then the end-of-document id (END in the mask)."""
    for path in jsonl:  # Before the slower tokenizer, a missing file names itself.
        if not pathlib.Path(path).is_file():
            raise ConfigError(f"prepare --jsonl {path}: no such file; give a JSONL file of chats")
    tokenizer = load_tokenizer(tokenizer_path)
    render, template_error = make_renderer(*find_template(tokenizer_path, template))
    ids, marks, count = [], [], 0
    for path in jsonl:
        for where, messages in read_conversations(path):
            try:
                tokens, mask = encode_conversation(messages, render, tokenizer.encode, where)
            except ConfigError:
                raise
            except (template_error, TypeError, ValueError) as e:  # The template's own code.
                raise ConfigError(
                    f"{where}: the chat template refused the conversation: {e}"
                ) from None
            ids.extend(tokens)
            ids.append(tokenizer.eos_id)
            marks.append(mask)
            marks.append([END])
            count += 1
    if not count:
        raise ConfigError(f"prepare --jsonl {' '.join(jsonl)}: no conversations in the file")
    dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32
    tokens, mask = np.asarray(ids, dtype), np.concatenate(marks).astype(np.uint8)
    try:
        save_token_file(out, tokens, tokenizer, loss_mask=mask)
    except OSError as e:
        raise ConfigError(
            f"prepare: cannot write --out {out} ({e}); choose a writable path"
        ) from None
    return dict(
        out=out,
        documents=count,
        tokens=int(tokens.size),
        trained=int(np.sum(mask == LOSS)),
        vocab_size=tokenizer.vocab_size,
    )
