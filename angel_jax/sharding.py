"""Logical axis names and the one table that maps them to mesh axes.

Model code names the dimensions of its params and activations with `LOGICAL_AXES`; `axis_rules`
decides where each lives on the mesh for a given config. ZeRO then adds its axes (the table's
`zero` entry: `data`, and `context` and `sequence` where split) to the param-shaped states it
shards (`zero_spec`). Compute layouts never contain that extra split, so under ZeRO-3 each
layer's weights are all-gathered where they are used and their gradients reduce-scattered on
the way back.
"""

import contextlib
import functools
import math

import jax
import ml_collections
import numpy as np
from flax import linen as nn
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from angel_jax.config import ConfigError
from angel_jax.mesh import CONTEXT, DATA, EXPERT, PIPELINE, SEQUENCE, TENSOR, zero_axes

LOGICAL_AXES = (
    "batch",
    "length",  # Sequence positions in attention and MLP regions.
    "norm_length",  # Sequence positions in norm/residual regions (Megatron sequence parallel).
    "embed",
    "heads",
    "kv_heads",
    "head_dim",
    "mlp",
    "vocab",
    "layers",
    "expert",  # Experts of a mixture-of-experts layer.
)

Rules = dict[str, str | tuple[str, ...] | None]


def axis_rules(config: ml_collections.ConfigDict, mesh: Mesh) -> Rules:
    """The logical -> mesh axis table for this config, after checking every divisibility."""
    m, t = config.model, config.train
    tp = mesh.shape[TENSOR]
    _check_divisible("config.model.num_heads", m.num_heads, "config.mesh.tensor", tp)
    if mesh.shape[SEQUENCE] > 1:  # Ulysses splits each tensor rank's heads further.
        sp = mesh.shape[SEQUENCE]
        names = "config.mesh.tensor x config.mesh.sequence"
        _check_divisible("config.model.num_heads", m.num_heads, names, tp * sp)
    _check_divisible("config.model.ffn_dim", m.ffn_dim, "config.mesh.tensor", tp)
    _check_divisible("config.model.vocab_size", m.vocab_size, "config.mesh.tensor", tp)
    ep = mesh.shape[EXPERT]
    if ep > 1:
        if not m.num_experts:
            raise ConfigError(
                f"config.mesh.expert={ep} needs a mixture-of-experts model: set "
                "config.model.num_experts, or config.mesh.expert=1"
            )
        _check_divisible("config.model.num_experts", m.num_experts, "config.mesh.expert", ep)
    # Expert parallel ranks also split the batch: tokens travel to their experts' ranks.
    batch_axes = (DATA, EXPERT) if ep > 1 else (DATA,)
    _check_divisible(
        "config.train.batch_size / config.train.microbatches",
        t.batch_size // t.microbatches,
        " x ".join(f"config.mesh.{a}" for a in batch_axes),
        math.prod(mesh.shape[a] for a in batch_axes),
    )
    pp = mesh.shape[PIPELINE]
    if pp > 1:  # Each pipeline microbatch is split over the batch axes.
        _check_divisible(
            "config.train.batch_size / config.pipeline.microbatches",
            t.batch_size // config.pipeline.microbatches,
            " x ".join(f"config.mesh.{a}" for a in batch_axes),
            math.prod(mesh.shape[a] for a in batch_axes),
        )
    # Sequence split over `context` (ring attention) and `sequence` (Ulysses), and in norm
    # regions also over `tensor` under Megatron sequence parallel.
    split = tuple(a for a in (CONTEXT, SEQUENCE) if mesh.shape[a] > 1)
    norm_split = split + ((TENSOR,) if m.sequence_parallel and tp > 1 else ())
    ways = math.prod(mesh.shape[a] for a in norm_split)
    names = " x ".join(f"config.mesh.{a}" for a in norm_split)
    _check_divisible("config.train.seq_len", t.seq_len, names, ways)
    if m.logits_chunks > 1:
        chunks = ways * m.logits_chunks
        _check_divisible(
            "config.train.seq_len", t.seq_len, f"config.model.logits_chunks x {names}", chunks
        )
    if m.mlp_chunks > 1:
        chunks = ways * m.mlp_chunks
        _check_divisible(
            "config.train.seq_len", t.seq_len, f"config.model.mlp_chunks x {names}", chunks
        )
    if mesh.shape[CONTEXT] > 1:  # Zigzag: 2 chunks per context rank, each split further.
        _check_divisible(
            "config.train.seq_len", t.seq_len, f"2 x {names} (ring attention's zigzag)", 2 * ways
        )
    if m.num_kv_heads % tp and tp % m.num_kv_heads:
        raise ConfigError(
            f"config.model.num_kv_heads={m.num_kv_heads} and config.mesh.tensor={tp}: one must "
            "divide the other (KV heads are split over tensor, or replicated when fewer)"
        )
    zero = _axes(zero_axes(mesh.shape, config.fp8.collectives))
    return {
        "batch": _axes(batch_axes),
        "length": _axes(split),
        "norm_length": _axes(norm_split),
        "embed": None,
        "heads": TENSOR,
        # Fewer KV heads than tensor ranks: each rank computes all KV heads (they are cheap
        # under GQA) and attention repeats them to the query heads it holds.
        "kv_heads": TENSOR if m.num_kv_heads % tp == 0 else None,
        "head_dim": None,
        "mlp": TENSOR,
        "vocab": TENSOR,
        # Stacked layers, stored stage by stage (parallel/pipeline.py), split over the stages.
        "layers": PIPELINE if pp > 1 else None,
        "expert": EXPERT if ep > 1 else None,
        # Not an array dimension: the axes ZeRO splits param-shaped states over (`zero_spec`).
        "zero": zero,
        # Those the params themselves are stored split over (ZeRO-3), else None.
        "zero_params": zero if config.zero_stage >= 3 else None,
    }


def _axes(names: tuple[str, ...]):
    """A rule's mesh axes: None, one name, or a tuple (major to minor)."""
    return None if not names else names[0] if len(names) == 1 else names


def active_mesh() -> Mesh | None:
    """The mesh of the active rules (None outside `use_rules`)."""
    return _active[-1][0] if _active else None


def active_spec(axes: tuple[str | None, ...]) -> P:
    """The PartitionSpec of logical `axes` under the active rules."""
    return logical_to_spec(axes, _active[-1][1])


def shard_map_mesh(mesh: Mesh):
    """The mesh for a shard_map or sharding constraint: inside a pipeline stage (a region
    already manual over `pipeline`), the context's abstract mesh, which they must use."""
    context = jax.sharding.get_abstract_mesh()
    return context if context.manual_axes else mesh


def in_partly_manual_region() -> bool:
    """Whether tracing is inside a region manual over some mesh axes (a pipeline stage) while
    other split axes stay automatic: where XLA's partitioner fails on some ops (cuDNN's
    attention call, a gather from a split table), which then run in a region manual over all."""
    region = jax.sharding.get_abstract_mesh()
    auto = [n for a, n in region.shape.items() if a not in region.manual_axes]
    return bool(region.manual_axes) and any(n > 1 for n in auto)


def _check_divisible(name: str, value: int, axis_name: str, size: int) -> None:
    if value % size:
        raise ConfigError(
            f"{name}={value} is not divisible by {axis_name}={size}; "
            f"change one so that {size} divides {value}"
        )


def logical_to_spec(axes: tuple[str | None, ...], rules: Rules) -> P:
    unknown = [a for a in axes if a is not None and a not in rules]
    if unknown:
        raise ValueError(f"logical axes {unknown} have no rule; known: {sorted(rules)}")
    return P(*(None if a is None else rules[a] for a in axes))


# The (mesh, rules) used by `constrain` while a model is traced.
_active: list[tuple[Mesh, Rules]] = []


@contextlib.contextmanager
def use_rules(mesh: Mesh, rules: Rules):
    """Makes `constrain` place activations with `rules` on `mesh` (no-op outside)."""
    _active.append((mesh, rules))
    try:
        yield
    finally:
        _active.pop()


@contextlib.contextmanager
def no_rules():
    """Turns `constrain` off: inside a `shard_map` manual over every split axis, each device
    works on its own block and there is nothing left to lay out."""
    saved = _active[:]
    _active.clear()
    try:
        yield
    finally:
        _active[:] = saved


def rule(name: str):
    """The mesh axes that logical axis `name` maps to now (None outside `use_rules`)."""
    return _active[-1][1][name] if _active else None


def gather_param(w: jax.Array, axes: tuple[str | None, ...]) -> jax.Array:
    """A param `w` already cast to the compute dtype, pinned to its logical `axes`' layout;
    under ZeRO-3 pinned to its stored split first, so the all-gather moves the compute dtype
    (unpinned, XLA at times gathers the float32 param and casts after: the LM head's
    kernel) and its gradient is reduce-scattered back to the split in it too."""
    zero = rule("zero_params")
    if zero is None:
        return constrain(w, axes)
    mesh = shard_map_mesh(active_mesh())
    stored = zero_spec(active_spec(axes), w.shape, mesh, zero)
    return constrain(jax.lax.with_sharding_constraint(w, NamedSharding(mesh, stored)), axes)


def constrain(x: jax.Array, axes: tuple[str | None, ...]) -> jax.Array:
    """Pins `x` to the layout of its logical `axes` under the active rules."""
    if not _active:
        return x
    mesh, rules = _active[-1]
    if x.ndim != len(axes):
        raise ValueError(f"array of shape {x.shape} given {len(axes)} logical axes {axes}")
    spec = logical_to_spec(axes, rules)
    return jax.lax.with_sharding_constraint(x, NamedSharding(shard_map_mesh(mesh), spec))


def regather(x: jax.Array, split: tuple[str | None, ...], axes: tuple[str | None, ...]):
    """`x` pinned to its `split` layout, then to `axes`'s (an all-gather where `axes` splits
    less: sequence parallel's norm region into attention or the MLP). Its backward pins the
    cotangent straight to `split`: the ranks' partial sums of it (a column-parallel layer's
    input gradient) meet in one reduce-scatter. Two plain constraints would transpose to an
    all-reduce over the whole `axes` layout, then a slice. Pinning `split` first keeps the
    all-gather in x's dtype (XLA otherwise gathers the float32 before a norm's cast). Reverse
    mode only (a custom_vjp): jax.jvp and jax.linear_transpose refuse it."""
    layouts = gather_layouts(x, split, axes)
    if layouts is None:
        return x
    split, whole = layouts
    if split == whole:
        return jax.lax.with_sharding_constraint(x, whole)
    return _regather(x, split, whole)


def gather_layouts(x: jax.Array, split: tuple[str | None, ...], axes: tuple[str | None, ...]):
    """(split, whole): the shardings of `x`'s logical `split` and `axes` under the active
    rules, for a gather from one to the other (`regather`, `linear.gathered_input`); None
    without rules."""
    if not _active:
        return None
    if x.ndim != len(split) or x.ndim != len(axes):
        raise ValueError(f"array of shape {x.shape} given logical axes {split} and {axes}")
    mesh, rules = _active[-1]
    mesh = shard_map_mesh(mesh)
    return tuple(NamedSharding(mesh, logical_to_spec(a, rules)) for a in (split, axes))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _regather(x, split, whole):
    return jax.lax.with_sharding_constraint(jax.lax.with_sharding_constraint(x, split), whole)


def _regather_fwd(x, split, whole):
    return _regather(x, split, whole), None


def _regather_bwd(split, whole, _, g):
    return (jax.lax.with_sharding_constraint(g, split),)


_regather.defvjp(_regather_fwd, _regather_bwd)


def logical_axes(boxed_tree) -> dict:
    """Logical axis names of each param (a PartitionSpec of names) from flax's boxed params."""
    return nn.get_partition_spec(boxed_tree)


def zero_spec(spec: P, shape: tuple[int, ...], mesh: Mesh, axes, keep: tuple[int, ...] = ()) -> P:
    """Adds ZeRO's `axes` (the rules' `zero` entry) to the largest free dimension their ranks
    divide, never to the dimensions in `keep`; where none divides by all of them, the largest
    leading group of them that does (`data` alone, say).

    A state too small to split stays replicated; that costs little, and every large weight
    matrix has a dimension divisible by any sensible data-parallel size.
    """
    entries = list(spec) + [None] * (len(shape) - len(spec))
    axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
    for n in range(len(axes), 0, -1):
        ranks = math.prod(mesh.shape[a] for a in axes[:n])
        free = [
            d
            for d, e in enumerate(entries)
            if e is None and shape[d] % ranks == 0 and d not in keep
        ]
        if free:
            entries[max(free, key=lambda d: shape[d])] = _axes(axes[:n])
            break
    return P(*entries)


def state_specs(logical_tree, abstract_tree, mesh: Mesh, rules: Rules, zero: bool):
    """PartitionSpecs for a param-shaped tree: the logical layout, plus ZeRO's axes if `zero`."""

    def one(names: P, abstract):
        spec = logical_to_spec(tuple(names), rules)
        # The layer axis stays whole: scans and the streamed update slice it per layer.
        layer_dims = tuple(d for d, n in enumerate(names) if n == "layers")
        return zero_spec(spec, abstract.shape, mesh, rules["zero"], layer_dims) if zero else spec

    return jax.tree.map(one, logical_tree, abstract_tree, is_leaf=lambda x: isinstance(x, P))


def named(mesh: Mesh, specs):
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def with_shardings(abstract, shardings):
    """ShapeDtypeStructs of `abstract`'s shapes and dtypes, each with its item of `shardings`."""
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
    )


def describe(tree) -> str:
    """A table of each array's path, shape, dtype, mesh layout and bytes per device."""
    rows = [("param", "shape", "dtype", "sharding", "MiB/device")]
    total = 0
    for path, x in jax.tree_util.tree_leaves_with_path(tree):
        sharding = x.sharding
        spec = sharding.spec if isinstance(sharding, NamedSharding) else sharding
        local = sharding.shard_shape(x.shape)
        nbytes = math.prod(local) * np.dtype(x.dtype).itemsize
        total += nbytes
        rows.append(
            (
                jax.tree_util.keystr(path, simple=True, separator="/"),
                str(tuple(x.shape)),
                str(np.dtype(x.dtype)),
                str(spec),
                f"{nbytes / 2**20:.2f}",
            )
        )
    rows.append(("total", "", "", "", f"{total / 2**20:.2f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
    )


def print_sharding(tree) -> None:
    """Prints `describe(tree)`: e.g. `print_sharding(state.params)` in a notebook."""
    print(describe(tree))
