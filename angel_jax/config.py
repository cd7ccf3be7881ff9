"""Config schema, defaults, command-line overrides and validation.

Every config file in `configs/` starts from `default_config()` and changes what it needs, so the
schema lives in one place and a typo on the command line is an error, not a silent new key.
"""

import ast
import difflib
import importlib.util
import json
import pathlib

import ml_collections

from angel_jax.remat import REMATS, STAGE_REMATS


class ConfigError(ValueError):
    """A bad setting or input, reported to the user as one line naming the setting and the fix."""


# Choices of config.model.moe_kernel and ring_blocks (angel_jax/kernels.py).
MOE_KERNELS = ("auto", "jax_pallas", "tokamax", "xla")
RING_KERNELS = ("auto", "cudnn", "tokamax", "xla")
# The options of enumerated settings, read by validation and by the modules that run them.
SCHEDULES = ("gpipe", "1f1b", "circular")  # parallel/pipeline.py
ROUTERS = ("topk", "expert_choice", "dropless")  # parallel/expert.py
ACTIVATION_TIERS = ("auto", "device", "host")  # planning/placement.py
# config.model.lora.targets: q, k, v, o (attention) and gate, up, down (a dense SwiGLU MLP).
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")  # layers/attention.py, layers/mlp.py


def default_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.zero_stage = 1  # 0: replicated; 1: +optimizer state sharded; 2: +grads; 3: +params (FSDP).
    # A local Hugging Face checkpoint directory (Llama or Mixtral: config.json + safetensors) to
    # start from instead of a random init; it sets config.model's architecture. A checkpoint of
    # our own in the workdir still wins (resume). "": random init (angel_jax/interop).
    c.init_from_hf = ""

    # Mesh axis sizes; one may be -1 for "all remaining devices".
    c.mesh = ml_collections.ConfigDict(
        dict(data=-1, pipeline=1, expert=1, context=1, sequence=1, tensor=1)
    )

    # Pipeline parallelism over config.mesh.pipeline stages (angel_jax/parallel/pipeline.py).
    c.pipeline = ml_collections.ConfigDict()
    c.pipeline.schedule = "1f1b"  # gpipe | 1f1b (interleaved with virtual stages) | circular.
    c.pipeline.microbatches = 4  # The batch goes through the stages in this many parts.
    c.pipeline.virtual_stages = 1  # Chunks per stage, for 1f1b or circular.
    # Layers per stage: auto (cost model: the embedding on the first stage, the LM head and
    # loss on the last) | even | counts per chunk, e.g. "12,10".
    c.pipeline.balance = "auto"
    # The layers' remat policy (config.model.remat is then unused): auto (the fastest that fits
    # the device memory) | dots_attention | dots_no_batch | attention | full. What it saves is
    # kept for every microbatch in flight, from its forward to its backward.
    c.pipeline.remat = "auto"

    c.model = ml_collections.ConfigDict()
    # llama (also Mixtral with num_experts) | gpt2 | bert | t5 (angel_jax/models/__init__.py).
    c.model.family = "llama"
    c.model.num_layers = 2  # T5: the encoder's.
    c.model.d_model = 64
    c.model.num_heads = 4
    c.model.num_kv_heads = 2
    c.model.head_dim = 0  # 0: d_model // num_heads.
    c.model.ffn_dim = 128
    c.model.vocab_size = 512
    c.model.rope_theta = 10000.0
    # Longer contexts than the model trained on (layers/attention.py RopeScaling): kind none |
    # linear | llama3 (Llama 3.1's, with the two frequency factors and the original length).
    c.model.rope_scaling = ml_collections.ConfigDict(
        dict(
            kind="none",
            factor=1.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_positions=8192,
        )
    )
    c.model.norm_eps = 1e-5
    c.model.tie_embeddings = False
    c.model.dtype = "bfloat16"  # Compute dtype; master params are always float32.
    # none | full | dots | dots_no_batch | dots_attention | attention | offload_dots
    # (angel_jax/remat.py), or auto: the fastest of dots_attention, dots_no_batch, attention,
    # full (by what each recomputes at this sequence length) with which the ZeRO-Cache plan
    # fits, checked against the compiled step on a GPU (angel_jax/planning/).
    c.model.remat = "none"
    c.model.attention = "auto"  # auto (cudnn on GPU, xla elsewhere) | cudnn | xla.
    # Ring attention's (context axis) block kernels: auto (cuDNN's flash attention where it
    # runs, else tokamax's Mosaic GPU kernels, else xla) | cudnn | tokamax | xla (einsums).
    # angel_jax/kernels.py.
    c.model.ring_blocks = "auto"
    # LM head + cross entropy over this many slices of the sequence, one at a time (recomputed
    # in the backward pass): the float32 logits of the whole sequence never exist at once.
    c.model.logits_chunks = 1
    # The dense MLP (with its norm) over this many interleaved slices of the sequence, one at a
    # time under remat: its (seq_len, ffn_dim) temporaries shrink by as much (long context).
    c.model.mlp_chunks = 1
    # Mixture of experts in every layer's MLP (angel_jax/layers/moe.py); 0 experts: dense.
    c.model.num_experts = 0
    c.model.experts_per_token = 2
    c.model.moe_ffn_dim = 0  # Each expert's hidden size; 0: ffn_dim.
    c.model.router = "topk"  # topk (capacity, drops) | expert_choice | dropless.
    # dropless's grouped matmuls: auto (the fastest that runs: JAX's Hopper Mosaic GPU grouped
    # GEMMs, then tokamax's, else xla) | jax_pallas | tokamax | xla (lax.ragged_dot).
    c.model.moe_kernel = "auto"
    c.model.capacity_factor = 1.25  # Slots per expert over the even share of assignments.
    # Capacity routers move the expert buffers in this many parts, so that one part's
    # all-to-all can overlap another's expert compute.
    c.model.moe_dispatch_chunks = 1
    c.model.shared_experts = 0  # Dense experts every token goes through (DeepSeek style).
    c.model.router_z_loss = 1e-3  # Weight of the router z-loss in the training loss.
    c.model.load_balance_loss = 1e-2  # Weight of the load-balancing loss.
    c.model.sequence_parallel = False  # Megatron-style: norm regions sharded over `tensor`.
    c.model.scan_layers = True
    c.model.max_positions = 1024  # GPT-2, BERT: rows of the learned position table.
    c.model.decoder_layers = 0  # T5: 0 means num_layers.
    c.model.relative_buckets = 32  # T5's relative position bias.
    c.model.relative_max_distance = 128
    # LoRA (angel_jax/lora.py): low-rank adapters A (in, rank) and B (rank, out) beside the
    # targeted projections, W x + alpha / rank * B A x, only they trained: the base weights
    # get no grads and no optimizer state. rank 0: off (full fine-tuning). Llama and Mixtral
    # (attention targets only for experts), without a pipeline, offload or PowerSGD.
    c.model.lora = ml_collections.ConfigDict(
        dict(rank=0, alpha=16.0, dropout=0.0, targets="q,k,v,o")
    )

    c.train = ml_collections.ConfigDict()
    c.train.steps = 100
    c.train.batch_size = 8  # Global, in sequences.
    c.train.seq_len = 128
    c.train.microbatches = 1  # Gradient accumulation: batch_size is split into this many.
    c.train.log_every_steps = 10
    c.train.optimizer = "adamw"  # adamw | adafactor (factored second moments, no momentum).
    c.train.lr = 3e-4
    c.train.warmup_steps = 10
    c.train.min_lr_ratio = 0.1  # Cosine decays to lr * min_lr_ratio at the last step.
    c.train.weight_decay = 0.1
    c.train.b1 = 0.9
    c.train.b2 = 0.95
    c.train.eps = 1e-8
    # AdamW's first moment in bfloat16 (optax's mu_dtype; changes the math, off by default):
    # 2 bytes a parameter less held, and moved each way by an offloaded update.
    c.train.mu_dtype = "float32"  # float32 | bfloat16
    c.train.grad_clip = 1.0  # Global-norm clipping; 0 disables.
    c.train.z_loss = 0.0  # Weight of mean(logsumexp(logits)^2).
    c.train.peak_tflops = 0.0  # Per device, for MFU; 0: from the device kind.
    c.train.tensorboard = True
    # The learning rate from the batch size (angel_jax/optim/scaling.py): `lr` and
    # `warmup_steps` are the values tuned at `lr_base_batch` sequences, moved to `batch_size` by
    # none | linear | sqrt | surge (Adam's rule of arXiv 2405.14578, peaking at lr_noise_batch).
    c.train.lr_scaling = "none"
    c.train.lr_base_batch = 0  # 0: batch_size, i.e. no change.
    c.train.lr_noise_batch = 0  # surge: the batch (sequences) at which the best lr peaks.
    # auto (the family's) | causal (llama, gpt2) | masked (bert) | span (t5: span corruption).
    c.train.objective = "auto"

    c.data = ml_collections.ConfigDict()
    c.data.path = ml_collections.FieldReference(None, field_type=str)  # None: default corpus.
    c.data.synthetic = False  # Random tokens, for benchmarks; data.path wins if set.
    c.data.prefetch = 2  # Batches prepared ahead by a background thread.
    # Segment ids at end-of-document tokens: no attention across the documents packed in a
    # row, positions restart at each (causal and masked objectives).
    c.data.packing = False
    # causal: learn only the tokens the token file's loss mask marks (the assistant's turns of
    # chat data, `prepare --jsonl`: data/chat.py); needs such a file.
    c.data.loss_mask = False
    c.data.mask_rate = 0.15  # masked: share of tokens to predict (BERT's 80/10/10 rule).
    # masked: the mask token; -1: the top id of config.model.vocab_size (reserved for it). An
    # imported BERT's tokenizer has its own ([MASK], 103 for bert-base-uncased).
    c.data.mask_id = -1
    c.data.noise_density = 0.15  # span: share of tokens corrupted,
    c.data.mean_span_length = 3.0  # in spans this long on average.

    c.checkpoint = ml_collections.ConfigDict()
    c.checkpoint.every_steps = 50  # 0 disables checkpoints.
    c.checkpoint.keep = 3
    c.checkpoint.async_save = True

    # Fault handling (angel_jax/monitor.py): numeric anomalies, stragglers, hangs.
    c.monitor = ml_collections.ConfigDict()
    # A non-finite loss or grad norm, or a loss spike: skip (the update is dropped inside the
    # step, the batch counts as used) | rollback (to the last checkpoint, the data moving on
    # past the anomaly) | log (an event, nothing else).
    c.monitor.on_anomaly = "skip"
    c.monitor.spike_zscore = 0.0  # A loss above mean + z * std of the window is a spike; 0: off.
    c.monitor.spike_window = 100  # Accepted losses the spike test looks back on (once full).
    c.monitor.max_consecutive_anomalies = 10  # More in a row stop the run (exit status 4).
    c.monitor.max_rollbacks = 5  # Per launch; one more stops the run (exit status 4).
    c.monitor.rollback_skip_batches = 0  # Batches dropped after the anomalous one on rollback.
    c.monitor.straggler_factor = 3.0  # Steps slower than this x the median are logged; 0: off.
    c.monitor.straggler_window = 50  # Steps the median is taken over.
    c.monitor.hang_timeout_s = 1800.0  # No step for this long: dump stacks, exit 3; 0: off.
    c.monitor.first_step_timeout_s = 3600.0  # The same for the first step (restore, compile).

    # ZeRO-Cache: where model states live (angel_jax/planning/placement.py).
    c.offload = ml_collections.ConfigDict()
    c.offload.policy = "none"  # none | optimizer | params | auto: docs/zero-cache.md "Policies".
    c.offload.device_gib = 0.0  # Memory budget per device; 0: measured.
    c.offload.host_gib = 0.0  # Host memory budget per process; 0: measured (MemAvailable).
    # Each layer's input (what remat keeps for the backward pass): auto (the planner's choice:
    # the device if the step fits there, else pinned host memory) | device | host.
    c.offload.activations = "auto"
    # Optimizer-state chunks on the device at once in the update; half of them are fetched
    # before the step is dispatched, so their copies run beside it.
    c.offload.chunks_in_flight = 2
    # With a bfloat16 compute copy on the device (not under layer streaming), the offloaded
    # float32 masters keep only their low 16 bits: the compute copy is their high half
    # (offload/masters.py). Exact; 2 bytes less per parameter each way and in host memory.
    c.offload.split_masters = True
    # SSD tier (policy auto): update chunks that fit in neither device nor host memory live in
    # this directory on local disk; "" turns the tier off.
    c.offload.ssd_dir = ""
    c.offload.ssd_gib = 0.0  # Budget on that disk per process; 0: its free space.
    c.offload.ssd_compress = False  # Optimizer state on disk in bfloat16 (masters stay exact).
    # Hybrid update: this share of the host-memory chunks' parameters is updated by the host's
    # cores (their masters and state in plain host memory) while the device updates the rest.
    # 0 by default: every share tried was slower than the device's update alone (offload/cpu.py).
    # -1: picked at startup from the host's and the copies' measured rates (0 if no share pays).
    c.offload.cpu_update = 0.0
    # One-step delayed update (ZeRO-Offload's DPU; off by default, it changes the math): step
    # t's update runs while step t+1's forward/backward does, so step t+1 computes on weights
    # without step t's update. The host cores' share (cpu_update) then runs beside the GPU's
    # compute; of the device's share only its prefetched chunks' copies do, its update kernels
    # queue behind the step, so without microbatches it hides little and was slower than the
    # exact update (docs/zero-cache.md "The update"). A checkpoint applies the waiting update
    # first (resuming from one gives the same run).
    c.offload.delayed_update = False
    # The offloaded update inside the forward/backward's program (exact math, one program a
    # step), for unrolled layers (config.model.scan_layers=false), whose host copies XLA
    # compiles as asynchronous copies it may run beside the compute. Each chunk waits for its
    # grad, and for the global grad norm when the step clips (train.grad_clip) or skips
    # anomalies (monitor.on_anomaly=skip): with either on the update runs after the backward
    # pass (docs/zero-cache.md "The update").
    c.offload.update_in_step = False
    # With update_in_step: every chunk is updated as if the step neither clips nor is
    # anomalous, so no chunk waits for the global grad norm and the update can run beside
    # the backward pass (SuperOffload's speculation, then validation). A step that clips or
    # is anomalous is then updated again from the old state, which the step keeps until
    # its norm is read (one sync a step; host memory holds the moved chunks twice during the
    # step, as the plan counts): metrics["update_redone"] says which. A step after one that
    # clipped runs the exact program (compiled beside the speculating one) until a step does
    # not clip: metrics["speculated"] says which ran. Exact either way. It pays when few steps
    # clip: a speculated step that clips costs more than an exact one (docs/zero-cache.md
    # "The update").
    c.offload.speculative_update = False

    # Cheaper math and communication (layers/linear.py, parallel/fp8_collectives.py).
    c.fp8 = ml_collections.ConfigDict()
    c.fp8.matmul = False  # Layer projections on FP8 GEMMs (e4m3 forward, e5m2 gradients).
    c.fp8.lm_head = False  # The LM head too (with fp8.matmul): its logits lose more precision.
    c.fp8.collectives = False  # ZeRO-3's param all-gathers and grad reduce-scatters in FP8.
    # PowerSGD rank for the data-parallel gradient average (optim/powersgd.py); 0: off.
    c.train.powersgd_rank = 0
    c.train.powersgd_start_step = 0  # Exact averaging before this step.
    return c


def shipped_configs() -> dict[str, pathlib.Path]:
    """The configs that ship with angel-jax, by name: angel_jax/configs in an installed wheel,
    the checkout's configs/ otherwise (pyproject.toml maps the one onto the other)."""
    here = pathlib.Path(__file__).resolve().parent
    for folder in (here / "configs", here.parent / "configs"):
        if folder.is_dir():
            return {f.stem: f for f in sorted(folder.glob("*.py")) if not f.name.startswith("_")}
    return {}


def find_config(path: str) -> pathlib.Path:
    """The file `--config PATH` names: PATH itself when it exists, else the shipped config that
    a bare name (`tiny`) or `configs/tiny.py` names, whatever the working directory."""
    file = pathlib.Path(path)
    if file.is_file():
        return file
    shipped = shipped_configs()
    name = file.name.removesuffix(".py")
    if file.parent in (pathlib.Path("."), pathlib.Path("configs")) and name in shipped:
        return shipped[name]
    raise ConfigError(
        f"--config {path}: no such file or shipped config; give a config file, e.g. "
        f"configs/tiny.py, or a shipped config's name: {', '.join(shipped) or 'none installed'}"
    )


def load_config(path: str, overrides: list[str] = ()) -> ml_collections.ConfigDict:
    """Loads `get_config()` from a config file (or a shipped config's name, see `find_config`)
    and applies `--config.a.b=value` overrides."""
    file = find_config(path)
    spec = importlib.util.spec_from_file_location(f"angel_config_{file.stem}", file)
    if spec is None:
        raise ConfigError(f"--config {path}: not a Python file; pass a .py file from configs/")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        if not hasattr(module, "get_config"):
            raise ConfigError(f"--config {path}: the file defines no get_config()")
        config = module.get_config()
    except ConfigError:
        raise
    except Exception as e:  # A user's file: report any failure in one line.
        where = f" (line {e.lineno})" if isinstance(e, SyntaxError) else ""
        raise ConfigError(
            f"--config {path}: loading it failed{where}: {type(e).__name__}: "
            f"{(str(e).splitlines() or [''])[0]}"
        ) from None
    _check_known_keys(config, default_config(), f"--config {path}")
    config.lock()
    apply_overrides(config, overrides)
    return config


def recorded_config(workdir: str, overrides: list[str] = ()) -> ml_collections.ConfigDict:
    """The config a training run recorded in WORKDIR/config.json (the train loop writes it at
    its start), with `overrides` applied: what export and generate use without --config."""
    path = pathlib.Path(workdir) / "config.json"
    fix = "pass --config, the run's config file, with the overrides it was trained with"
    if not path.is_file():
        raise ConfigError(f"--checkpoint {workdir}: no config.json there to read the run; {fix}")
    try:
        recorded = json.loads(path.read_text())
        config = default_config()
        config.update(recorded)
    except (ValueError, TypeError, KeyError) as e:  # Not JSON, or a value of another type.
        raise ConfigError(f"{path}: cannot be read as a run's config ({e}); {fix}") from None
    _check_known_keys(config, default_config(), str(path))
    config.lock()
    apply_overrides(config, overrides)
    return config


def _check_known_keys(config, defaults, source: str, prefix: str = "config") -> None:
    """A key a config file added that the defaults lack (a typo would otherwise be ignored)
    is an error naming the file, the key and the nearest known one."""
    for name in config.keys():
        key = f"{prefix}.{name}"
        if name not in defaults:
            close = difflib.get_close_matches(name, sorted(defaults.keys()), n=1)
            keys = ", ".join(sorted(defaults.keys()))
            hint = f"did you mean {prefix}.{close[0]}?" if close else f"keys of {prefix}: {keys}"
            raise ConfigError(f"{source}: unknown config key {key} ({hint})")
        if isinstance(config[name], ml_collections.ConfigDict) and isinstance(
            defaults[name], ml_collections.ConfigDict
        ):
            _check_known_keys(config[name], defaults[name], source, key)


def apply_overrides(config: ml_collections.ConfigDict, overrides: list[str]) -> None:
    """Sets each `--config.a.b=value`, parsed as the type the field already has."""
    for arg in overrides:
        if not arg.startswith("--config.") or "=" not in arg:
            raise ConfigError(f"{arg}: expected --config.KEY=VALUE")
        key, text = arg[len("--config.") :].split("=", 1)
        *parents, leaf = key.split(".")
        node = config
        for depth, name in enumerate(parents + [leaf]):
            if not isinstance(node, ml_collections.ConfigDict):
                above = ".".join(parents[:depth])
                raise ConfigError(
                    f"--config.{key}: config.{above} is a single value, not a group of settings; "
                    f"set it with --config.{above}=VALUE"
                )
            if name not in node:
                where = ".".join(parents[:depth]) or "config"
                close = difflib.get_close_matches(name, sorted(node.keys()), n=1)
                hint = (
                    f"did you mean {close[0]}?"
                    if close
                    else f"keys of {where}: {', '.join(sorted(node.keys()))}"
                )
                raise ConfigError(f"--config.{key}: unknown config key '{name}' ({hint})")
            if depth < len(parents):
                node = node[name]
        field_type = node.get_type(leaf)
        if isinstance(node[leaf], ml_collections.ConfigDict):
            first = sorted(node[leaf].keys())[0]
            raise ConfigError(
                f"--config.{key}: config.{key} is a group of settings; set one of them, "
                f"e.g. --config.{key}.{first}=VALUE"
            )
        try:
            node[leaf] = _parse_value(text, field_type)
        except (TypeError, ValueError) as e:
            raise ConfigError(
                f"--config.{key}={text}: wrong type, expected {field_type.__name__} ({e})"
            ) from None


def _parse_value(text: str, field_type: type):
    """`text` as a `field_type`; for str fields, `None` unsets (e.g. config.data.path)."""
    if field_type is bool:  # true/false as documented, or 1/0; other words are refused.
        if text.lower() in ("true", "1"):
            return True
        if text.lower() in ("false", "0"):
            return False
        raise ValueError("use true or false")
    if field_type is str:
        return None if text == "None" else text
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        raise ValueError(f"cannot read {text!r} as {field_type.__name__}") from None
    # ml_collections would take True for an int field; a bool there is a mistake.
    if field_type in (int, float) and isinstance(value, bool):
        raise ValueError("got a bool, give a number")
    if field_type is int and isinstance(value, float) and value.is_integer():
        value = int(value)
    if field_type is int and not isinstance(value, int):
        raise ValueError(f"got {type(value).__name__} {value!r}, give a whole number")
    if field_type is float and isinstance(value, int):
        value = float(value)
    if field_type is float and not isinstance(value, float):
        raise ValueError(f"got {type(value).__name__} {value!r}, give a number")
    return value


def head_dim(model: ml_collections.ConfigDict) -> int:
    return model.head_dim or model.d_model // model.num_heads


FAMILY_OBJECTIVES = {"llama": "causal", "gpt2": "causal", "bert": "masked", "t5": "span"}


def objective(config: ml_collections.ConfigDict) -> str:
    """The training objective: config.train.objective, or the family's when auto."""
    chosen = config.train.objective
    return FAMILY_OBJECTIVES.get(config.model.family, "causal") if chosen == "auto" else chosen


def choose(setting: str, value, options) -> None:
    """Refuses a value of an enumerated `config.SETTING` that is not one of `options`, naming
    them and the nearest one."""
    if value in options:
        return
    close = difflib.get_close_matches(str(value), [str(o) for o in options], n=1, cutoff=0.5)
    hint = f"; did you mean {close[0]}?" if close else ""
    raise ConfigError(f"config.{setting}={value!r}: use one of {', '.join(options)}{hint}")


def validate(config: ml_collections.ConfigDict) -> None:
    """Checks settings that do not depend on the devices (mesh checks live in mesh.py), one
    section at a time; `angel_jax.models.validate` adds the family's features before them."""
    _validate_family(config)
    _validate_features(config)
    _validate_model(config.model)
    _validate_lora(config)
    _validate_train(config)
    _validate_pipeline(config)
    _validate_io(config)
    _validate_monitor(config)


def _validate_features(config: ml_collections.ConfigDict) -> None:
    """FP8, PowerSGD, Hugging Face init and offload: the settings that need others."""
    if config.fp8.lm_head and not config.fp8.matmul:
        raise ConfigError(
            "config.fp8.lm_head puts the LM head on FP8 GEMMs beside the layers' projections: "
            "set config.fp8.matmul=true too, or turn it off"
        )
    if config.fp8.collectives and config.zero_stage != 3:
        raise ConfigError(
            f"config.fp8.collectives carries ZeRO-3's parameter all-gathers, but "
            f"config.zero_stage={config.zero_stage}: set config.zero_stage=3 or turn it off"
        )
    if config.train.powersgd_rank:
        others = [a for a, n in config.mesh.items() if a != "data" and n != 1]
        if config.train.powersgd_rank < 0 or config.zero_stage > 1 or others:
            raise ConfigError(
                f"config.train.powersgd_rank={config.train.powersgd_rank} compresses the "
                f"data-parallel average of replicated grads: it needs a positive rank, "
                f"config.zero_stage 0 or 1 (here {config.zero_stage}) and no mesh axis but data "
                f"(here {others or 'none'} > 1)"
            )
        if config.offload.policy != "none" or config.train.microbatches > 1:
            raise ConfigError(
                f"config.train.powersgd_rank={config.train.powersgd_rank} needs "
                "config.offload.policy=none and config.train.microbatches=1"
            )
    if config.init_from_hf:
        _validate_init_from_hf(config)
    if config.offload.chunks_in_flight < 1:
        raise ConfigError(
            f"config.offload.chunks_in_flight={config.offload.chunks_in_flight}: must be >= 1"
        )
    share = config.offload.cpu_update
    if not (0 <= share <= 1 or share == -1):
        raise ConfigError(
            f"config.offload.cpu_update={share}: a share of the parameters, in [0, 1], or -1 "
            "to pick it from measured rates"
        )
    choose("offload.activations", config.offload.activations, ACTIVATION_TIERS)
    if config.offload.activations == "host" and config.model.remat == "none":
        raise ConfigError(
            "config.offload.activations=host keeps each layer's input in host memory for remat "
            "to recompute from, but config.model.remat=none keeps everything on the device: "
            "set config.model.remat (full for long context) or offload.activations=auto"
        )


def _validate_model(m: ml_collections.ConfigDict) -> None:
    for name in ("num_layers", "d_model", "num_heads", "num_kv_heads", "ffn_dim", "vocab_size"):
        if m[name] <= 0:
            raise ConfigError(f"config.model.{name}={m[name]}: must be positive")
    if m.head_dim < 0:
        raise ConfigError(f"config.model.head_dim={m.head_dim}: use 0 (d_model // num_heads) or >0")
    if not m.head_dim and m.d_model % m.num_heads:
        raise ConfigError(
            f"config.model.d_model={m.d_model} is not divisible by num_heads={m.num_heads}; "
            "change one of them or set config.model.head_dim"
        )
    if m.head_dim % 2 or (not m.head_dim and (m.d_model // m.num_heads) % 2):
        raise ConfigError(
            f"config.model.head_dim={head_dim(m)} is odd; rotary embeddings rotate pairs of "
            "channels, so set config.model.head_dim (or d_model / num_heads) to an even number"
        )
    rs = m.rope_scaling
    choose("model.rope_scaling.kind", rs.kind, ("none", "linear", "llama3"))
    if rs.factor <= 0 or (rs.kind == "llama3" and rs.high_freq_factor <= rs.low_freq_factor):
        raise ConfigError(
            f"config.model.rope_scaling: factor={rs.factor} must be positive and "
            f"high_freq_factor={rs.high_freq_factor} above low_freq_factor={rs.low_freq_factor}"
        )
    if m.num_heads % m.num_kv_heads:
        raise ConfigError(
            f"config.model.num_heads={m.num_heads} is not divisible by "
            f"config.model.num_kv_heads={m.num_kv_heads}; GQA needs each KV head shared by the "
            "same number of query heads"
        )
    choose("model.remat", m.remat, ("auto", *REMATS))
    if m.mlp_chunks < 1:
        raise ConfigError(f"config.model.mlp_chunks={m.mlp_chunks}: use 1 or more")
    if m.mlp_chunks > 1 and m.num_experts:
        raise ConfigError(
            "config.model.mlp_chunks slices the dense MLP; MoE layers slice their dispatch: "
            "set config.model.moe_dispatch_chunks instead and mlp_chunks=1"
        )
    choose("model.attention", m.attention, ("auto", "cudnn", "xla"))
    choose("model.router", m.router, ROUTERS)
    if m.num_experts and not 1 <= m.experts_per_token <= m.num_experts:
        raise ConfigError(
            f"config.model.experts_per_token={m.experts_per_token}: must be between 1 and "
            f"config.model.num_experts={m.num_experts}"
        )
    if m.moe_dispatch_chunks < 1:
        raise ConfigError(
            f"config.model.moe_dispatch_chunks={m.moe_dispatch_chunks}: use 1 or more"
        )
    choose("model.ring_blocks", m.ring_blocks, RING_KERNELS)
    choose("model.moe_kernel", m.moe_kernel, MOE_KERNELS)
    choose("model.dtype", m.dtype, ("bfloat16", "float16", "float32"))


def lora_targets(model: ml_collections.ConfigDict) -> tuple[str, ...]:
    """config.model.lora.targets as names ("q,k,v,o" -> ("q", "k", "v", "o"))."""
    return tuple(t.strip() for t in model.lora.targets.split(",") if t.strip())


def _validate_lora(config: ml_collections.ConfigDict) -> None:
    lo = config.model.lora
    if lo.rank < 0:
        raise ConfigError(f"config.model.lora.rank={lo.rank}: use 0 (off) or a positive rank")
    if not lo.rank:
        return
    targets = lora_targets(config.model)
    if not targets:
        raise ConfigError(
            f"config.model.lora.targets={lo.targets!r} names no projection; use some of "
            f"{','.join(LORA_TARGETS)}"
        )
    for target in targets:
        choose("model.lora.targets", target, LORA_TARGETS)
    if len(set(targets)) != len(targets):
        raise ConfigError(f"config.model.lora.targets={lo.targets!r} names a projection twice")
    if lo.alpha <= 0 or not 0 <= lo.dropout < 1:
        raise ConfigError(
            f"config.model.lora.alpha={lo.alpha}, dropout={lo.dropout}: alpha must be "
            "positive and dropout in [0, 1)"
        )
    mlp = [t for t in targets if t in ("gate", "up", "down")]
    if mlp and config.model.num_experts:
        raise ConfigError(
            f"config.model.lora.targets={lo.targets!r}: {','.join(mlp)} adapt a dense MLP, "
            "and this model's MLPs are experts: keep the attention targets (q,k,v,o)"
        )
    # The adapters train on the plain step: these keep their own param and state layouts.
    unsupported = {
        "config.mesh.pipeline=1": config.mesh.pipeline != 1,
        "config.offload.policy=none": config.offload.policy != "none",
        "config.train.powersgd_rank=0": config.train.powersgd_rank != 0,
    }
    needs = [setting for setting, bad in unsupported.items() if bad]
    if needs:
        raise ConfigError(
            f"config.model.lora.rank={lo.rank} trains adapters on the plain step, without a "
            f"pipeline, offload or PowerSGD: set {' and '.join(needs)}, or lora.rank=0"
        )


def _validate_train(config: ml_collections.ConfigDict) -> None:
    t = config.train
    for name in ("steps", "batch_size", "seq_len", "log_every_steps", "microbatches"):
        if t[name] <= 0:
            raise ConfigError(f"config.train.{name}={t[name]}: must be positive")
    if config.zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"config.zero_stage={config.zero_stage}: must be 0, 1, 2 or 3")
    if config.seed < 0:
        raise ConfigError(f"config.seed={config.seed}: must be >= 0")
    if t.lr < 0 or t.warmup_steps < 0:
        raise ConfigError(
            f"config.train.lr={t.lr}, warmup_steps={t.warmup_steps}: neither may be negative"
        )
    choose("train.optimizer", t.optimizer, ("adamw", "adafactor"))
    choose("train.mu_dtype", t.mu_dtype, ("float32", "bfloat16"))
    if t.mu_dtype != "float32" and t.optimizer != "adamw":
        raise ConfigError(
            f"config.train.mu_dtype={t.mu_dtype} is AdamW's first moment, and "
            f"config.train.optimizer={t.optimizer} keeps none: leave mu_dtype=float32"
        )
    if t.batch_size % t.microbatches:
        raise ConfigError(
            f"config.train.batch_size={t.batch_size} is not divisible by "
            f"config.train.microbatches={t.microbatches}"
        )


def _validate_pipeline(config: ml_collections.ConfigDict) -> None:
    t = config.train
    pc = config.pipeline
    choose("pipeline.schedule", pc.schedule, SCHEDULES)
    for name in ("microbatches", "virtual_stages"):
        if pc[name] < 1:
            raise ConfigError(f"config.pipeline.{name}={pc[name]}: must be at least 1")
    if pc.balance not in ("auto", "even") and not all(
        n.strip().isdigit() for n in pc.balance.split(",")
    ):
        raise ConfigError(
            f"config.pipeline.balance={pc.balance!r}: use auto, even or layer counts like 12,10"
        )
    if config.mesh.pipeline != 1 and t.batch_size % pc.microbatches:
        raise ConfigError(
            f"config.train.batch_size={t.batch_size} is not divisible by "
            f"config.pipeline.microbatches={pc.microbatches}; change one so that it divides"
        )
    stage_remats = ("auto", *STAGE_REMATS)
    choose("pipeline.remat", pc.remat, stage_remats)


def _validate_io(config: ml_collections.ConfigDict) -> None:
    if config.data.prefetch < 0:
        raise ConfigError(f"config.data.prefetch={config.data.prefetch}: must be 0 or more")
    if config.checkpoint.every_steps < 0:
        raise ConfigError(
            f"config.checkpoint.every_steps={config.checkpoint.every_steps}: must be 0 "
            "(no checkpoints) or more"
        )
    if config.checkpoint.keep < 1:
        raise ConfigError(
            f"config.checkpoint.keep={config.checkpoint.keep}: must be at least 1; "
            "set config.checkpoint.every_steps=0 to save none"
        )


def _validate_init_from_hf(config: ml_collections.ConfigDict) -> None:
    path = pathlib.Path(config.init_from_hf)
    if not (path / "config.json").is_file():
        raise ConfigError(
            f"config.init_from_hf={config.init_from_hf}: no config.json there; pass a local "
            'Hugging Face checkpoint directory (config.json + *.safetensors), or "" for a '
            "random init"
        )
    if config.mesh.pipeline != 1 or config.offload.policy != "none":
        raise ConfigError(
            f"config.init_from_hf loads into the plain layout only for now: it needs "
            f"config.mesh.pipeline=1 and config.offload.policy=none (here "
            f"{config.mesh.pipeline}, {config.offload.policy})"
        )


def _validate_monitor(config: ml_collections.ConfigDict) -> None:
    mon, t = config.monitor, config.train
    choose("monitor.on_anomaly", mon.on_anomaly, ("skip", "rollback", "log"))
    for name in ("spike_zscore", "straggler_factor", "hang_timeout_s", "first_step_timeout_s"):
        if mon[name] < 0:
            raise ConfigError(f"config.monitor.{name}={mon[name]}: must be 0 (off) or more")
    for name in ("spike_window", "straggler_window"):
        if mon[name] < 2:
            raise ConfigError(f"config.monitor.{name}={mon[name]}: must be at least 2")
    if mon.max_consecutive_anomalies < 1:
        raise ConfigError(
            f"config.monitor.max_consecutive_anomalies={mon.max_consecutive_anomalies}: must be "
            "at least 1"
        )
    if mon.max_rollbacks < 0 or mon.rollback_skip_batches < 0:
        raise ConfigError(
            f"config.monitor.max_rollbacks={mon.max_rollbacks}, rollback_skip_batches="
            f"{mon.rollback_skip_batches}: neither may be negative"
        )
    if mon.on_anomaly == "rollback" and config.checkpoint.every_steps == 0:
        raise ConfigError(
            "config.monitor.on_anomaly=rollback needs checkpoints to roll back to; set "
            "config.checkpoint.every_steps > 0 or use on_anomaly=skip"
        )
    choose("train.lr_scaling", t.lr_scaling, ("none", "linear", "sqrt", "surge"))
    if t.lr_base_batch < 0 or t.lr_noise_batch < 0:
        raise ConfigError(
            f"config.train.lr_base_batch={t.lr_base_batch}, lr_noise_batch={t.lr_noise_batch}: "
            "neither may be negative"
        )
    if t.lr_scaling == "surge" and t.lr_noise_batch == 0:
        raise ConfigError(
            "config.train.lr_scaling=surge needs config.train.lr_noise_batch, the batch at "
            "which the best learning rate peaks (B_noise, measured at small scale)"
        )


def _validate_family(config: ml_collections.ConfigDict) -> None:
    m, d, family = config.model, config.data, config.model.family
    choose("model.family", family, FAMILY_OBJECTIVES)
    goal = objective(config)
    if goal != FAMILY_OBJECTIVES[family]:
        raise ConfigError(
            f"config.train.objective={config.train.objective!r} does not fit "
            f"config.model.family={family}, which trains with {FAMILY_OBJECTIVES[family]!r}; "
            "set config.train.objective=auto"
        )
    if family in ("gpt2", "bert") and config.train.seq_len > m.max_positions:
        raise ConfigError(
            f"config.train.seq_len={config.train.seq_len} is longer than the position table, "
            f"config.model.max_positions={m.max_positions}; raise max_positions or shorten it"
        )
    # Packing and the loss mask make rows that only the objectives' loss reads (losses.py).
    rows = "config.data.packing" if d.packing else "config.data.loss_mask" if d.loss_mask else ""
    if rows and (config.mesh.context != 1 or config.mesh.sequence != 1):
        raise ConfigError(
            f"{rows} needs the whole sequence per device (its masks): set "
            f"config.mesh.context=1 and config.mesh.sequence=1, or {rows}=false"
        )
    if rows and (config.mesh.pipeline > 1 or m.logits_chunks > 1):
        raise ConfigError(
            f"{rows}: the pipeline schedules and chunked logits read plain token "
            "windows; set config.mesh.pipeline=1 and config.model.logits_chunks=1, or "
            f"{rows}=false"
        )
    if d.loss_mask and (goal != "causal" or not d.path):
        raise ConfigError(
            "config.data.loss_mask learns the tokens a chat token file marks: it needs the "
            "causal objective and config.data.path, a file from `python -m "
            "angel_jax.data.prepare --jsonl`; set both, or config.data.loss_mask=false"
        )
    if d.packing and goal == "span":
        raise ConfigError(
            "config.data.packing: span corruption makes one example of each window (its "
            "padding masked by segment ids); set config.data.packing=false for t5"
        )
    if not 0 < d.mask_rate < 1 or not 0 < d.noise_density < 1:
        raise ConfigError(
            f"config.data.mask_rate={d.mask_rate}, noise_density={d.noise_density}: both must "
            "lie strictly between 0 and 1"
        )
    if d.mask_id >= m.vocab_size:
        raise ConfigError(
            f"config.data.mask_id={d.mask_id} is not below config.model.vocab_size="
            f"{m.vocab_size}; use the tokenizer's mask id, or -1 for the top id"
        )
    if d.mean_span_length < 1:
        raise ConfigError(f"config.data.mean_span_length={d.mean_span_length}: must be >= 1")
