"""Exports a training run's latest checkpoint as a Hugging Face checkpoint directory, which
`transformers`' from_pretrained loads and `--config.init_from_hf` imports again.

    python -m angel_jax.export --checkpoint /tmp/angel-tiny --out /tmp/angel-tiny-hf \\
        [--max-shard-size 5GB] [--dtype bfloat16] [--overwrite] [--config FILE]

The run's config is the one its workdir recorded (config.json), `--config.KEY=VALUE` overrides
on top (e.g. a mesh for the devices at hand). With --config, pass the config and the overrides
the run was trained with: a model setting that would change the exported config.json is named
with its fix (settings of how to compute, such as kernels, remat or dtype, may differ). --out gets
config.json and the weights as safetensors: model.safetensors, or, above --max-shard-size,
shards model-00001-of-0000N.safetensors with model.safetensors.index.json, as transformers
writes them. With them goes the run's tokenizer: the tokenizer files of its init_from_hf
checkpoint, else the tokenizer.json its token file was made with (config.data.path, from
`angel_jax.data.prepare --tokenizer`), else none (bytes, synthetic data); --tokenizer names one.

Every family with a Hugging Face converter exports (angel_jax/family.py `Family.converter`):
llama (Llama; Mixtral with experts, none shared), gpt2, bert and t5.

A LoRA run (config.model.lora.rank > 0) exports merged: each adapted kernel written as
W + alpha / rank * A B, the plain model that computes what the adapted one does.
"""

import functools
import importlib
import json
import pathlib
import re
import shutil
import sys
from types import ModuleType

import jax

from angel_jax import lora
from angel_jax.checkpoint import UnreadableCheckpoint
from angel_jax.cli import Parser
from angel_jax.config import ConfigError
from angel_jax.data.tokens import ByteTokenizer
from angel_jax.generate import load_params_for
from angel_jax.models import FAMILIES, family_of

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
# --max-shard-size units, read as transformers reads them.
UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def shard_bytes(size: str) -> int:
    """The bytes of a --max-shard-size such as 5GB, 500MB or 2GiB."""
    match = re.fullmatch(r"(\d+)\s*([KMG]i?B|B)?", size.strip(), re.IGNORECASE)
    if not match or int(match[1]) == 0:
        raise ConfigError(f"--max-shard-size {size}: give a size such as 5GB, 500MB or 2GiB")
    return int(match[1]) * UNITS[(match[2] or "B").upper()]


def check_paths(workdir: pathlib.Path, out: pathlib.Path, overwrite: bool) -> None:
    """Refuses, before anything loads, a --checkpoint that is no training workdir and an --out
    whose files would mix with another checkpoint's."""
    if not (workdir / "checkpoints").is_dir():
        raise ConfigError(
            f"--checkpoint {workdir}: no checkpoints/ in it; pass the --workdir of a training "
            "run that saved one (config.checkpoint.every_steps > 0)"
        )
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file; pass a new or empty directory")
    if out.exists() and out.resolve() == workdir.resolve():
        raise ConfigError(f"--out {out} is the --checkpoint workdir; pass another directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ConfigError(
            f"--out {out} is not empty; choose a new directory, or pass --overwrite to replace "
            "the checkpoint files in it"
        )


def run_config(workdir: pathlib.Path, config) -> dict:
    """The run's config as a dict: as its workdir recorded it (loop.py), else `config`."""
    recorded = workdir / "config.json"
    if recorded.is_file():
        return json.loads(recorded.read_text())
    return json.loads(config.to_json_best_effort())


def tokenizer_files(flag: str | None, run: dict) -> list[tuple[pathlib.Path, str]]:
    """(source, name in --out) of the tokenizer files to write beside the weights:
    --tokenizer's, else the run's (`run`: its config as a dict)."""
    if flag:
        if not pathlib.Path(flag).is_file():
            raise ConfigError(f"--tokenizer {flag}: no such file; give a tokenizer.json")
        return [(pathlib.Path(flag), "tokenizer.json")]
    if run.get("init_from_hf"):  # Fine-tuning data is tokenized with the checkpoint's own.
        hf = pathlib.Path(run["init_from_hf"])
        found = [(hf / name, name) for name in TOKENIZER_FILES if (hf / name).is_file()]
        if found:
            return found
    data = run.get("data", {}).get("path")
    meta = pathlib.Path(data).with_suffix(".json") if data else None
    if meta is None or not meta.is_file():
        return []
    name = json.loads(meta.read_text()).get("tokenizer")  # data/tokens.py save_token_file.
    if name in (None, ByteTokenizer.name):
        return []
    if not pathlib.Path(name).is_file():
        raise ConfigError(
            f"config.data.path={data} was tokenized with {name}, which is not there now; pass "
            "that tokenizer.json as --tokenizer"
        )
    return [(pathlib.Path(name), "tokenizer.json")]


def _flat(tree: dict, prefix: str) -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}.{key}"))
        else:
            out[f"{prefix}.{key}"] = value
    return out


def converter_of(model) -> ModuleType:
    """The Hugging Face converter (angel_jax/interop/) of config.model's family."""
    family = family_of(model)
    if family.converter is None:
        exporting = sorted(f.name for f in FAMILIES.values() if f.converter)
        raise ConfigError(
            f"config.model.family={family.name} has no Hugging Face converter; these export: "
            f"{', '.join(exporting)}"
        )
    return importlib.import_module(family.converter)


def model_overrides(converter: ModuleType, model, run: dict) -> list[str]:
    """The overrides that give `model` (config.model) the run's settings where the config.json
    written from them would differ; the settings it does not carry (kernels, remat, dtype) only
    say how a machine computes, and may differ."""
    ours = _flat(json.loads(model.to_json_best_effort()), "model")
    differ = {k: v for k, v in _flat(run.get("model", {}), "model").items() if ours.get(k, v) != v}
    theirs = model.copy_and_resolve_references()
    for key, value in differ.items():
        *path, name = key.split(".")[1:]
        try:
            setattr(functools.reduce(getattr, path, theirs), name, value)
        except (TypeError, ValueError):  # Recorded with another type (an older version).
            pass
    written = converter.hf_config(model), converter.hf_config(theirs)
    if written[0] == written[1]:
        return []
    carried = {k for hf in written for k in converter.model_settings(hf)}
    text = lambda v: json.dumps(v) if isinstance(v, bool) else str(v)  # true, 1e-05, None.
    return [f"--config.{k}={text(v)}" for k, v in differ.items() if k.split(".")[1] in carried]


def lora_overrides(model, run: dict) -> list[str]:
    """The overrides that give `model` the run's LoRA settings where they differ: the
    checkpoint's params and the merge (alpha / rank) follow them."""
    theirs = run.get("model", {}).get("lora", {})
    if not model.lora.rank and not theirs.get("rank"):
        return []
    keys = ("rank", "alpha", "targets")
    return [
        f"--config.model.lora.{k}={theirs[k]}"
        for k in keys
        if k in theirs and theirs[k] != model.lora[k]
    ]


def export(exp, params, out: pathlib.Path, dtype: str, max_shard_bytes: int, tokenizer) -> list:
    """Writes `params` (in `exp`'s training layout) with its family's converter, and the
    `tokenizer` files ((source, name) pairs), to `out`; returns the names of the files there."""
    if exp.pipeline:  # Layers stored stage by stage: the converters read them in order.
        params = dict(
            params, layers=jax.tree.map(exp.pipeline.layout.from_stages, params["layers"])
        )
    if exp.optimizer.adapters_only:  # LoRA: the adapters folded into their kernels.
        params = lora.merged(params, exp.model_config.lora.scale)
    for name in ("config.json", *TOKENIZER_FILES):  # None left from an export overwritten.
        (out / name).unlink(missing_ok=True)
    converter_of(exp.config.model).save_params(
        out, params, exp.config.model, dtype, max_shard_bytes
    )
    for source, name in tokenizer:
        shutil.copyfile(source, out / name)
    return sorted(p.name for p in out.iterdir())


def export_run(args, overrides: list[str]) -> list[str]:
    """Exports the run that the parsed `args` and `overrides` name; returns the names of the
    files in --out."""
    from angel_jax.config import load_config, recorded_config
    from angel_jax.mesh import make_mesh
    from angel_jax.train import build

    workdir, out = pathlib.Path(args.checkpoint), pathlib.Path(args.out)
    max_shard_bytes = shard_bytes(args.max_shard_size)
    check_paths(workdir, out, args.overwrite)
    if args.config:
        config = load_config(args.config, overrides)
    else:
        config = recorded_config(workdir, overrides)
    run = run_config(workdir, config)
    tokenizer = tokenizer_files(args.tokenizer, run)
    exp = build(config, make_mesh(config.mesh), fit_compiled=False)  # No step runs.
    fixes = model_overrides(converter_of(exp.config.model), exp.config.model, run)
    fixes += lora_overrides(exp.config.model, run)
    if fixes:
        raise ConfigError(
            f"--checkpoint {workdir} was trained with other model settings (its config.json): "
            f"pass {' '.join(fixes)}"
        )
    try:
        params = load_params_for(exp, str(workdir), masters=True)
    except UnreadableCheckpoint as e:  # Its advice is for training: start over.
        why = e.reason or "none of them"
        raise ConfigError(
            f"--checkpoint {workdir}: no checkpoint there can be read ({why}); the files are "
            "damaged, or the run was trained with another config than --config and its overrides"
        ) from None
    try:
        out.mkdir(parents=True, exist_ok=True)
        return export(exp, params, out, args.dtype, max_shard_bytes, tokenizer)
    except OSError as e:
        raise ConfigError(
            f"--out {out}: cannot write there ({e}); pass another directory"
        ) from None


def main(argv: list[str] | None = None) -> int:
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--config", help="the run's config file or shipped name (default: the one it recorded)"
    )
    parser.add_argument("--checkpoint", required=True, help="the run's workdir (latest checkpoint)")
    parser.add_argument("--out", required=True, help="the Hugging Face directory to write")
    parser.add_argument(
        "--max-shard-size",
        default="5GB",
        help="split the weights above this (default 5GB; e.g. 500MB, 2GiB)",
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="of the weights written (default float32: the masters as they are)",
    )
    parser.add_argument("--tokenizer", help="a tokenizer.json to write (default: the run's)")
    parser.add_argument(
        "--overwrite", action="store_true", help="replace the checkpoint files in a non-empty --out"
    )
    args, overrides = parser.parse_known_args(argv)
    jax.config.update("jax_threefry_partitionable", True)
    try:
        written = export_run(args, overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    shards = [n for n in written if re.fullmatch(r"model-\d+-of-\d+\.safetensors", n)]
    if shards:  # One entry for them all.
        written = [n for n in written if n not in shards] + [f"{len(shards)} weight shards"]
    print(f"exported {args.checkpoint} to {args.out}: {', '.join(written)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
