"""Resume on another mesh: a checkpoint's state converted to this run's layout.

What a checkpoint holds depends on the mesh only through its shardings, which orbax reshards
on restore (another device or process count, data x tensor, ZeRO stage). Three settings change
the state's form instead: the ZeRO-Cache offload keeps each stacked weight as one array per
layer (`offload/state.py`), split masters keep float32 masters as low halves beside a bfloat16
compute copy (`offload/masters.py`), and the pipeline stores the layers stage by stage
(`parallel/pipeline.py`, `StageLayout`). A checkpoint saved in another form is read into host
memory in its own form, brought to the model's form (whole float32 masters, layers in order),
then to this run's, and placed in this run's shardings. So `Reshard` is what
`checkpoint.Checkpointer.restore` is given to convert; the data position (a global batch
index) and the step (the learning-rate schedule's) carry over as they are.
"""

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import linen as nn

from angel_jax.models import family_of
from angel_jax.offload.masters import LOW, join_numpy, split_numpy
from angel_jax.parallel.pipeline import StageLayout
from angel_jax.state_layout import TrainState

# The settings besides the model's that give the state its shapes: named when they changed.
_STATE_SETTINGS = ("train.optimizer", "train.mu_dtype")


def layout_of(exp) -> dict:
    """The form of `exp`'s checkpointed state, as checkpoints record it (JSON)."""
    stages = exp.pipeline.layout if exp.pipeline else None
    return {
        "offload_policy": exp.plan.policy,
        "split_masters": bool(exp.plan.split_masters),
        "pipeline": None
        if stages is None
        else [stages.stages, stages.virtual, list(stages.layers_per_chunk)],
    }


def settings_of(config) -> dict:
    """The settings that decide the state's shapes, flat (`model.d_model`: 128), JSON."""
    flat = {f"model.{k}": v for k, v in config.model.to_dict().items()}
    for key in _STATE_SETTINGS:
        section, name = key.split(".")
        flat[key] = config[section][name]
    return json.loads(json.dumps(flat, default=str))


class Reshard:
    """Converts a checkpointed state of any layout into `exp`'s (see the module's doc)."""

    def __init__(self, exp):
        self.exp = exp
        self.layout = layout_of(exp)
        self.settings = settings_of(exp.config)

    def saved_target(self, layout: dict):
        """The abstract checkpointed state (ShapeDtypeStructs, no shardings) of this model in
        `layout`: what a checkpoint saved under that layout holds."""
        return to_layout(self._canonical(), layout, self.exp.stacked, self._compute_dtype())

    def convert(self, saved, layout: dict):
        """`saved` (numpy, in `layout`'s form) in this run's checkpointed form, placed as
        `exp.checkpoint_target()` says (the chunks its SSD and CPU tiers hold as numpy)."""
        stacked = self.exp.stacked
        state = to_layout(from_layout(saved, layout, stacked), self.layout, stacked)
        target = self.exp.checkpoint_target()
        return jax.tree.map(_place, target, state)

    def _compute_dtype(self):
        return self.exp.offloaded.dtype if self.exp.offloaded else jnp.bfloat16

    def _canonical(self) -> TrainState:
        """Shapes of the state in the model's form: float32 masters, layers in order."""
        exp = self.exp
        tokens = jax.ShapeDtypeStruct((1, exp.config.train.seq_len), jnp.int32)
        inputs = family_of(exp.config.model).example_inputs(tokens)
        params = jax.eval_shape(exp.model.init, jax.random.key(0), *inputs)["params"]
        params = nn.meta.unbox(params)
        opt = jax.eval_shape(lambda p: exp.optimizer.init(p, exp.stacked), params)
        comm = exp.abstract_state.comm
        bare = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
        step = jax.ShapeDtypeStruct((), jnp.int32)
        return TrainState(step, *jax.tree.map(bare, (params, opt)), None, jax.tree.map(bare, comm))


def to_layout(state: TrainState, layout: dict, stacked, compute_dtype=jnp.bfloat16):
    """A state in the model's form (numpy or ShapeDtypeStructs) -> its checkpointed form under
    `layout`: layers stage by stage (pipeline), masters split (their low halves, the compute
    copy their high halves), stacked weights one array per layer (offloaded)."""
    params, opt, compute = state.params, state.opt_state, None
    stages = _stage_layout(layout)
    if stages:
        params, opt = (_on_layers(lambda x: _to_stages(stages, x), t) for t in (params, opt))
    if layout["split_masters"]:
        compute = jax.tree.map(lambda m: _high_half(m, compute_dtype), params)
        params = jax.tree.map(_low_half, params)
    if layout["offload_policy"] != "none":
        opt = jax.tree.map(
            lambda s, p, sub: (
                tuple(jax.tree.map(lambda x, i=i: _layer(x, i), sub) for i in range(p.shape[0]))
                if s
                else sub
            ),
            stacked,
            params,
            opt,
        )
        params = jax.tree.map(
            lambda s, p: tuple(_layer(p, i) for i in range(p.shape[0])) if s else p,
            stacked,
            params,
        )
    return TrainState(state.step, params, opt, compute, state.comm)


def from_layout(state: TrainState, layout: dict, stacked) -> TrainState:
    """The inverse of `to_layout`, on numpy: the state in the model's form."""
    params, opt = state.params, state.opt_state
    if layout["offload_policy"] != "none":
        params = jax.tree.map(lambda s, p: np.stack(p) if s else p, stacked, params)
        opt = jax.tree.map(
            lambda s, sub: jax.tree.map(lambda *xs: np.stack(xs), *sub) if s else sub,
            stacked,
            opt,
        )
    if layout["split_masters"]:
        whole = lambda m, c: join_numpy(m, c) if m.dtype == LOW else m
        params = jax.tree.map(whole, params, state.compute_params)
    stages = _stage_layout(layout)
    if stages:
        params, opt = (_on_layers(stages.from_stages, t) for t in (params, opt))
    return TrainState(state.step, params, opt, None, state.comm)


def _stage_layout(layout: dict) -> StageLayout | None:
    if not layout["pipeline"]:
        return None
    stages, virtual, counts = layout["pipeline"]
    return StageLayout(stages, virtual, tuple(counts))


def _on_layers(fn, tree):
    """`fn` on every array of the stacked layers (params["layers"], or their state's)."""
    return {**tree, "layers": jax.tree.map(fn, tree["layers"])}


def _to_stages(stages: StageLayout, x):
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct((len(stages.slot_layer), *x.shape[1:]), x.dtype)
    keep = (stages.slot_layer >= 0).reshape(-1, *[1] * (x.ndim - 1))
    return np.where(keep, x[np.maximum(stages.slot_layer, 0)], 0).astype(x.dtype)


def _layer(x, i):
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape[1:], x.dtype)
    return x[i]


def _low_half(m):
    if isinstance(m, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(m.shape, LOW)
    return split_numpy(m)


def _high_half(m, dtype):
    """The bfloat16 compute copy `masters.split` makes: the high half, rounded."""
    if isinstance(m, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(m.shape, dtype)
    bits = np.asarray(m, np.float32).view(np.uint32)
    high = ((bits + np.uint32(0x8000)) >> np.uint32(16)).astype(np.uint16)
    return np.where(np.isnan(m), m.astype(ml_dtypes.bfloat16), high.view(ml_dtypes.bfloat16))


def _place(target, x):
    """`x` (numpy) as `target` says: numpy for a tier outside the state tree, else an array
    in its sharding (each process fills its own shards)."""
    if target.shape != x.shape:
        raise AssertionError(f"resharding made {x.shape}, the target is {target.shape}")
    x = np.asarray(x, target.dtype)
    if isinstance(target, np.ndarray):
        return x
    return jax.make_array_from_callback(x.shape, target.sharding, lambda index: x[index])
