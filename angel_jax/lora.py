"""LoRA (Hu et al. 2021): a targeted projection W gets two small matrices beside it, A (its
inputs, rank) and B (rank, its outputs), and computes W x + alpha / rank * B A x. A starts
small and random and B at zero, so training starts from the base model; only A and B train:
the base weights get no gradient and no optimizer state (`adapters` is the part of a
params-shaped tree that the optimizer and the gradients see). `merged` folds the adapters
into their kernels for export.

Dropout (on an adapter's input) draws from the key that the gradient code makes for each step
and microbatch (`dropout_key`); the model is applied with it through `Dropout`; without a key
(evaluation, generation, export) there is none.

Param names: a targeted `Linear` holds `kernel` (in..., out...), `lora_a` (in..., rank) and
`lora_b` (rank, out...), each with a leading "layers" axis when the layers are scanned.
"""

import contextlib
import dataclasses
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import ml_collections

from angel_jax.config import lora_targets

ADAPTERS = ("lora_a", "lora_b")


@dataclasses.dataclass(frozen=True)
class LoRA:
    """config.model.lora, for the layers: `targets` from config.LORA_TARGETS."""

    rank: int
    alpha: float
    dropout: float = 0.0
    targets: tuple[str, ...] = ()

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def on(self, target: str) -> "LoRA | None":
        """This LoRA where `target` (a projection's name in config.LORA_TARGETS) takes one."""
        return self if target in self.targets else None

    @classmethod
    def from_config(cls, model: ml_collections.ConfigDict) -> "LoRA | None":
        """config.model.lora, or None when its rank is 0 (off)."""
        lo = model.lora
        if not lo.rank:
            return None
        return cls(lo.rank, lo.alpha, lo.dropout, lora_targets(model))


def on(lora: LoRA | None, target: str) -> LoRA | None:
    return lora.on(target) if lora else None


def adapters(tree):
    """The adapters' part of a params-shaped tree of nested dicts (params, their shardings,
    specs or flags): the same nesting, only the `lora_a` and `lora_b` leaves."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            part = adapters(value)
            if part:
                out[key] = part
        elif key in ADAPTERS:
            out[key] = value
    return out


def base(tree):
    """A params-shaped tree less its adapters: the base model's part."""
    return {
        key: base(value) if isinstance(value, Mapping) else value
        for key, value in tree.items()
        if key not in ADAPTERS
    }


def with_adapters(tree, part):
    """`tree` (with its adapters or its `base` alone) with the leaves of `part` (an
    `adapters`-shaped tree) put in their places."""
    out = dict(tree)
    for key, value in part.items():
        out[key] = with_adapters(tree.get(key, {}), value) if isinstance(value, Mapping) else value
    return out


def merged_kernel(kernel: jax.Array, a: jax.Array, b: jax.Array, scale: float) -> jax.Array:
    """kernel + scale * A B in float32: A (L..., in..., r) and B (L..., r, out...), `L` a
    leading "layers" axis that the three share or not."""
    lead = a.ndim + b.ndim - 2 - kernel.ndim  # 1 when stacked over layers.
    layers = kernel.shape[:lead]
    a_LIR = a.reshape(*layers, -1, a.shape[-1]).astype(jnp.float32)
    b_LRO = b.reshape(*layers, b.shape[lead], -1).astype(jnp.float32)
    delta = jnp.matmul(a_LIR, b_LRO).reshape(kernel.shape)
    return (kernel.astype(jnp.float32) + scale * delta).astype(kernel.dtype)


def merged(params, scale: float):
    """`params` with each adapted kernel replaced by kernel + scale * A B and the adapters
    left out: the base model's tree, which computes what the adapted model computes."""
    out = {}
    for key, value in params.items():
        if not isinstance(value, Mapping):
            if key not in ADAPTERS:
                out[key] = value
        elif "lora_a" in value:
            rest = {k: v for k, v in value.items() if k not in ADAPTERS}
            rest["kernel"] = merged_kernel(value["kernel"], value["lora_a"], value["lora_b"], scale)
            out[key] = rest
        else:
            out[key] = merged(value, scale)
    return out


# The dropout keys of the loss being traced (`dropout_key`); None: no dropout.
_keys: list = [None]


@contextlib.contextmanager
def dropout_key(key):
    """Makes the models applied through `Dropout` inside the block draw LoRA dropout from `key`
    (a traced key array, or None: no dropout)."""
    _keys.append(key)
    try:
        yield
    finally:
        _keys.pop()


@dataclasses.dataclass(frozen=True)
class Dropout:
    """A Flax module's stand-in for the loss: its `apply`, with the active `dropout_key` as
    the "dropout" rng."""

    module: object

    def apply(self, variables, *args, **kwargs):
        rngs = {} if _keys[-1] is None else {"dropout": _keys[-1]}
        return self.module.apply(variables, *args, rngs=rngs, **kwargs)


def flops_per_token(model_config, params, seq_len: int) -> float:
    """Training FLOPs a token (the family's `flops_per_token`) of a model with `params` (a
    params-shaped tree, abstract or not): with adapters, the frozen matmuls run forward and
    for their inputs' grads only (4 x their params, not 6 x: no weight grads), the adapters all
    three passes (6 x theirs)."""
    full = model_config.flops_per_token(seq_len)
    if getattr(model_config, "lora", None) is None:
        return full
    trained = sum(x.size for x in jax.tree.leaves(adapters(params)))
    return full - 2 * model_config.matmul_params() + 6 * trained
