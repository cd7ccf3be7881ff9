"""Text generation for our decoders (Llama, Mixtral, GPT-2): greedy or temperature/top-k
sampling with a KV cache.

    python -m angel_jax.generate --checkpoint /tmp/angel-tiny \\
        --prompt "The quick" --steps 32 [--temperature 0.8 --top-k 40]
    python -m angel_jax.generate --checkpoint /tmp/angel-tiny \\
        --prompt-tokens 72,101,108,108,111 --steps 32
    python -m angel_jax.generate --config configs/llama_finetune.py \\
        --config.init_from_hf=/path/to/hf_llama --prompt-tokens 1,450,4996 --steps 16

The decode path applies the model's own layers (models/llama.py, models/gpt2.py) to its
params, one layer at a time under `lax.scan`, with each layer's keys and values kept in a cache
of the full length: the prompt fills it in one pass, then each step adds one token. It is jitted
under the training rules (the params in their training layout, batch over `data`, heads over
`tensor`). GPT-2 generates at most config.model.max_positions positions, its table's rows;
past the length the model was trained at (config.train.seq_len) generation warns. Text is
refused where the tokenizer cannot decode the model's ids: give --tokenizer, or use ids.
A --checkpoint run's config is the one it recorded (its workdir's config.json) unless --config
names one.

Letters: B batch, T new tokens, S cache length, D model dim, N query heads, K kv heads,
G query heads per kv head, H head dim, V vocabulary, L layers.
"""

import functools
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from angel_jax import sharding
from angel_jax.checkpoint import saved_run
from angel_jax.cli import Parser
from angel_jax.config import ConfigError
from angel_jax.models import FAMILIES, family_of, load_params
from angel_jax.sharding import constrain

CACHE_AXES = ("layers", "batch", None, "kv_heads", "head_dim")
# The families generate() covers: those with a KV-cache layer (family.py).
DECODERS = tuple(name for name, f in FAMILIES.items() if f.pieces and f.pieces.decode_layer)


def init_cache(pieces, cfg, batch: int, length: int) -> dict:
    """Keys and values of every layer, (L, B, S, K, H) each, zero until written."""
    shape = (cfg.num_layers, batch, length, pieces.kv_heads(cfg), cfg.head_dim)
    zeros = jnp.zeros(shape, jnp.dtype(cfg.dtype))
    return dict(k=constrain(zeros, CACHE_AXES), v=constrain(zeros, CACHE_AXES))


def stacked_layers(pieces, cfg, params):
    """The layers' params with a leading layer axis, whether scanned (`layers`) or not."""
    if "layers" in params:
        return params["layers"]
    per_layer = [params[pieces.unrolled_name.format(i)] for i in range(cfg.num_layers)]
    return jax.tree.map(lambda *xs: jnp.stack(xs), *per_layer)


def forward_with_cache(pieces, cfg, params, tokens_BT, cache: dict, start):
    """(logits (B, T, V) float32, cache) for tokens at positions start..start+T-1, given
    the cache of every earlier position."""
    h_BTD = pieces.embed(cfg, params, tokens_BT, start)

    def step(h_BTD, layer_cache):
        p, k_BSKH, v_BSKH = layer_cache
        return pieces.decode_layer(cfg, p, h_BTD, k_BSKH, v_BSKH, start)  # (h, (k, v)).

    layers = (stacked_layers(pieces, cfg, params), cache["k"], cache["v"])
    h_BTD, (k, v) = jax.lax.scan(step, h_BTD, layers)
    cache = dict(k=constrain(k, CACHE_AXES), v=constrain(v, CACHE_AXES))
    h_BTD = pieces.final_norm(cfg, params, h_BTD)
    return pieces.lm_head(cfg, params)(h_BTD).astype(jnp.float32), cache


def sample(logits_BV, rng, temperature, top_k):
    """Next tokens (B,): the argmax when temperature is 0, else a draw from the softmax of
    logits / temperature over the `top_k` likeliest (all when top_k is 0). Both may be traced,
    so one compiled program serves every setting."""
    greedy = jnp.argmax(logits_BV, axis=-1)
    scaled = logits_BV / jnp.where(temperature > 0, temperature, 1.0)
    vocab = logits_BV.shape[-1]
    kth = jnp.sort(scaled, axis=-1)[:, vocab - jnp.where(top_k > 0, top_k, vocab)]
    scaled = jnp.where(scaled < kth[:, None], -jnp.inf, scaled)
    drawn = jax.random.categorical(rng, scaled, axis=-1)
    return jnp.where(temperature > 0, drawn, greedy).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("pieces", "cfg", "steps", "with_logits"))
def generate_tokens(
    pieces,
    cfg,
    params,
    prompt_BT,
    rng,
    temperature,
    top_k,
    steps: int,
    with_logits: bool = False,
):
    """The prompt followed by `steps` generated tokens, (B, T + steps); `with_logits` also
    the logits each token was drawn from, (B, steps, V) float32."""
    b, t = prompt_BT.shape
    cache = init_cache(pieces, cfg, b, t + steps)
    logits, cache = forward_with_cache(pieces, cfg, params, prompt_BT, cache, 0)
    first = sample(logits[:, -1], jax.random.fold_in(rng, 0), temperature, top_k)

    def step(carry, i):
        token_B, cache = carry
        logits, cache = forward_with_cache(pieces, cfg, params, token_B[:, None], cache, t + i)
        nxt = sample(logits[:, -1], jax.random.fold_in(rng, i + 1), temperature, top_k)
        return (nxt, cache), (token_B, logits[:, -1] if with_logits else None)

    (last, _), (tokens_SB, logits_SBV) = jax.lax.scan(step, (first, cache), jnp.arange(steps - 1))
    tokens = jnp.concatenate([prompt_BT, tokens_SB.T, last[:, None]], axis=1)
    if not with_logits:
        return tokens
    return tokens, jnp.concatenate([logits[:, -1:], logits_SBV.swapaxes(0, 1)], axis=1)


def generate(
    exp,
    params,
    prompt_BT,
    steps: int,
    temperature: float = 0.0,
    top_k: int = 0,
    seed: int = 0,
    with_logits: bool = False,
):
    """Generates with an `Experiment`'s model (`exp` from `train.build`), its params in the
    training layout, jitted under its sharding rules. Returns (B, T + steps) tokens, and
    with `with_logits` the (B, steps, V) logits each new token was drawn from."""
    model = exp.config.model
    if model.family not in DECODERS:
        raise ConfigError(
            f"generate: config.model.family={model.family!r}; generation covers the decoders "
            f"{', '.join(DECODERS)} (llama: Llama, Mixtral)"
        )
    if steps < 1 or temperature < 0 or top_k < 0 or top_k > exp.model_config.vocab_size:
        raise ConfigError(
            f"generate: steps={steps}, temperature={temperature}, top_k={top_k}: need steps >= "
            f"1, temperature >= 0 (0: greedy), 0 <= top_k <= vocab_size (0: all tokens)"
        )
    prompt_BT = np.asarray(prompt_BT, np.int32)
    vocab = exp.model_config.vocab_size
    outside = np.unique(prompt_BT[(prompt_BT < 0) | (prompt_BT >= vocab)])
    if outside.size:  # The embedding lookup would clamp them silently.
        raise ConfigError(
            f"generate: prompt token ids {', '.join(map(str, outside[:5]))} lie outside the "
            f"vocabulary 0..{vocab - 1} (config.model.vocab_size={vocab})"
        )
    length = prompt_BT.shape[1] + steps
    positions = getattr(exp.model_config, "max_positions", None)  # A learned table's rows.
    if positions is not None and length > positions:
        raise ConfigError(
            f"generate: {prompt_BT.shape[1]} prompt tokens + {steps} steps = {length} positions, "
            f"more than the position table, config.model.max_positions={positions}"
            "; shorten the prompt or generate fewer steps"
        )
    trained, source = trained_length(exp.config)
    if length > trained:  # RoPE extrapolates silently; GPT-2's rows past it are untrained.
        print(
            f"warning: {prompt_BT.shape[1]} prompt tokens + {steps} steps = {length} positions, "
            f"past the {trained} the model was trained at ({source}); the text there may "
            "degrade",
            file=sys.stderr,
        )
    # The sequence is never split here: one new token a step.
    rules = dict(exp.rules, length=None, norm_length=None)
    batch_ways = np.prod([exp.mesh.shape[a] for a in jax.tree.leaves(rules["batch"])])
    if prompt_BT.shape[0] % batch_ways:  # Too few prompts to split: each device runs all.
        rules["batch"] = None
    batch = NamedSharding(exp.mesh, sharding.logical_to_spec(("batch", None), rules))
    prompt_BT = jax.device_put(prompt_BT, batch)
    rng, temperature, top_k = jax.random.key(seed), np.float32(temperature), np.int32(top_k)
    with sharding.use_rules(exp.mesh, rules):  # constrain() lays out what it traces so.
        out = generate_tokens(
            family_of(model).pieces,
            exp.model_config,
            params,
            prompt_BT,
            rng,
            temperature,
            top_k,
            steps,
            with_logits,
        )
    return jax.tree.map(np.asarray, jax.device_get(out))


def trained_length(config) -> tuple[int, str]:
    """(positions the model was trained at, the setting that says so): config.train.seq_len,
    or a Hugging Face checkpoint's own length where that is longer."""
    length = config.train.seq_len, f"config.train.seq_len={config.train.seq_len}"
    if config.init_from_hf:
        try:
            hf = json.loads((pathlib.Path(config.init_from_hf) / "config.json").read_text())
        except (OSError, ValueError):
            return length
        n = hf.get("max_position_embeddings") or hf.get("n_positions") or 0
        if n > length[0]:
            return n, f"max_position_embeddings={n} in config.init_from_hf's config.json"
    return length


def load_params_for(exp, checkpoint: str | None, masters: bool = False):
    """Params for generation: the latest of our checkpoints in the workdir `checkpoint`, or the
    Hugging Face checkpoint at config.init_from_hf. With `masters`, an offloaded run's float32
    masters (as numpy arrays; what an export writes) instead of its compute copy."""
    if checkpoint:
        from angel_jax.checkpoint import Checkpointer

        keep = exp.config.checkpoint.keep  # As the run kept them: nothing is deleted.
        ckpt = Checkpointer(saved_run(checkpoint), 0, keep, async_save=False, read_only=True)
        try:
            found = ckpt.restore_latest(exp.checkpoint_target(), *exp.checkpoint_layout)
        finally:  # Closed on every path: an open one's thread prints tracebacks at exit.
            ckpt.close()
        if found is None:
            raise ConfigError(f"--checkpoint {checkpoint}: no checkpoint there")
        state = exp.from_checkpointed(found.state)
        if exp.offloaded and masters:
            return exp.params_numpy(state)
        if exp.offloaded:  # The masters are in host memory, per layer: take the compute copy.
            device = lambda x: jax.device_put(x, x.sharding.with_memory_kind("device"))
            return jax.tree.map(device, state.compute_params)
        return state.params
    if exp.config.init_from_hf:
        abstract, shardings = exp.abstract_state.params, exp.state_sharding.params
        return load_params(exp.config.init_from_hf, abstract, shardings, "config.init_from_hf")
    raise ConfigError(
        "nothing to generate with: pass --checkpoint WORKDIR (a training run's) or "
        "--config.init_from_hf=DIR (a Hugging Face checkpoint)"
    )


USE_IDS = "or --prompt-tokens IDS to give and print token ids"


def prompt_tokenizer(path: str | None, config):
    """The tokenizer of --prompt: --tokenizer's tokenizer.json, else the Hugging Face
    checkpoint's (config.init_from_hf), else the byte tokenizer (the default corpus's)."""
    from angel_jax.data.tokens import load_tokenizer

    if path is None and config.init_from_hf:
        path = str(pathlib.Path(config.init_from_hf) / "tokenizer.json")
        if not pathlib.Path(path).is_file():  # Its ids are its tokenizer's, never bytes.
            raise ConfigError(
                f"--prompt: config.init_from_hf={config.init_from_hf} has no tokenizer.json; "
                f"pass the model's --tokenizer FILE, {USE_IDS}"
            )
    return load_tokenizer(path)


def check_tokenizer(config, vocab_size: int, tokenizer) -> None:
    """Refuses, before the weights load, a tokenizer that decodes fewer ids than the model
    learned: random ones over its whole vocabulary, or those of its token file's tokenizer.
    (The default corpus is bytes; what else a model emits is checked once generated.)"""
    if config.data.path:
        try:
            meta = pathlib.Path(config.data.path).with_suffix(".json")
            meta = json.loads(meta.read_text())
        except (OSError, ValueError):  # Not on this machine: nothing to tell.
            return
        learned = meta.get("vocab_size", 0)
        source = f"config.data.path's tokenizer, {meta.get('tokenizer')}"
    elif config.data.synthetic:
        learned, source = vocab_size, "config.data.synthetic: random ids"
    else:
        return
    if learned > tokenizer.vocab_size:
        raise ConfigError(
            f"--prompt: the model learned ids 0..{learned - 1} ({source}), but the tokenizer "
            f"{tokenizer.name} decodes 0..{tokenizer.vocab_size - 1}; pass the data's "
            f"--tokenizer FILE, {USE_IDS}"
        )


def check_decoded(new_tokens, vocab_size: int, tokenizer) -> None:
    """Refuses generated ids the tokenizer cannot decode (decode() would drop them)."""
    outside = np.unique(new_tokens[new_tokens >= tokenizer.vocab_size])
    if outside.size:
        raise ConfigError(
            f"the model (config.model.vocab_size={vocab_size}) generated ids "
            f"{', '.join(map(str, outside[:5]))} that the tokenizer {tokenizer.name} cannot "
            f"decode (it has 0..{tokenizer.vocab_size - 1}); pass the --tokenizer FILE of the "
            f"model's training data, {USE_IDS}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--config",
        help="a config file or a shipped config's name, e.g. tiny (default: the one the "
        "--checkpoint run recorded)",
    )
    parser.add_argument("--checkpoint", help="a training run's workdir (its latest checkpoint)")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="text, encoded by --tokenizer; prints text")
    prompt.add_argument("--prompt-tokens", help="token ids, e.g. 1,450,4996; prints ids")
    parser.add_argument(
        "--tokenizer",
        help="a Hugging Face tokenizer.json for --prompt (default: the init_from_hf "
        "checkpoint's; without one, bytes)",
    )
    parser.add_argument("--steps", type=int, default=32, help="tokens to generate")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-k", type=int, default=0, help="sample from the k likeliest")
    parser.add_argument("--seed", type=int, default=0)
    args, overrides = parser.parse_known_args(argv)
    jax.config.update("jax_threefry_partitionable", True)
    from angel_jax.config import load_config, recorded_config
    from angel_jax.mesh import make_mesh
    from angel_jax.train import build

    try:
        if args.checkpoint:  # Before the model is built: a wrong path is said at once.
            saved_run(args.checkpoint)
        if args.config:
            config = load_config(args.config, overrides)
        elif args.checkpoint:
            config = recorded_config(args.checkpoint, overrides)
        else:
            raise ConfigError(
                "pass --config (a config file or a shipped config's name), or the "
                "--checkpoint of a training run"
            )
        tokenizer = None
        if args.prompt is not None:
            tokenizer = prompt_tokenizer(args.tokenizer, config)
            prompt = [tokenizer.encode(args.prompt)]
            if not prompt[0]:
                raise ConfigError("--prompt is empty: give some text to continue")
        else:
            try:
                prompt = [[int(t) for t in args.prompt_tokens.split(",")]]
            except ValueError:
                raise ConfigError(
                    f"--prompt-tokens {args.prompt_tokens}: give comma-separated token ids"
                ) from None
        exp = build(config, make_mesh(config.mesh), fit_compiled=False)  # No train step runs.
        vocab = exp.model_config.vocab_size  # Set by build from an init_from_hf checkpoint.
        if tokenizer is not None:
            check_tokenizer(config, vocab, tokenizer)
        params = load_params_for(exp, args.checkpoint)
        tokens = generate(exp, params, prompt, args.steps, args.temperature, args.top_k, args.seed)
        if tokenizer is not None:
            check_decoded(tokens[0, len(prompt[0]) :], vocab, tokenizer)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if tokenizer is None:
        print(",".join(str(t) for t in tokens[0]))
    else:
        print(tokenizer.decode(tokens[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
