"""Remat policies: one table, read by config validation, the models and both memory planners
(through angel_jax/planning/memory.py); angel_jax/planning/activations.py chooses among them.

Each entry names its JAX checkpoint policy and what the planners need of it: the values it
keeps on the device per layer and token for the backward pass, in widths of (model dim,
attention width, KV width, FFN width) of the compute dtype (checked against the compiled layer
in tests/test_pipeline.py), the named activations it keeps in pinned host memory instead, and,
for the policies a pipeline offers, the share of the forward work it recomputes.
"""

import dataclasses
import functools
from collections.abc import Callable

import jax

# Activations the layers name (checkpoint_name) so remat policies can save or offload them,
# with their widths in units of (model dim, attention width, KV width, FFN width): a dense
# Llama layer's Q, K and V; the attention output; the gate and up projections' outputs.
OFFLOADABLE = {"qkv": (0, 1, 2, 0), "attn_out": (0, 1, 0, 0), "mlp_in": (0, 0, 0, 2)}


# The residual stream entering a layer: what every remat policy keeps for the backward pass
# (one d_model value per token and layer), and what config.offload.activations=host keeps in
# pinned host memory instead.
LAYER_INPUT = "layer_input"


# The attention's forward results its backward pass takes, named where the attention is ours:
# the ring's merged output and log-sum-exp (parallel/attention.py). Without them the backward
# pass runs the whole ring forward again.
ATTENTION_RESULTS = "attention_results"


def flash_attention_saveable(prim, *_, **params) -> bool:
    """The attention's forward results: cuDNN flash attention's output and softmax statistics
    (its forward primitive as JAX's public attention binds it), or the ring's merged ones.
    Without them the backward pass runs the forward again (about 4% of a llama_1b step; at
    long context most of a full-remat step's recompute). The ring's cuDNN blocks bind the core
    primitive: their per-block results are not kept, the merged ones are."""
    if prim.name == "name":
        return params.get("name") == ATTENTION_RESULTS
    return prim.name == "dot_product_attention_fwd_wrapper"


@dataclasses.dataclass(frozen=True)
class Remat:
    policy: Callable | None  # For jax.checkpoint; None: no remat.
    # Kept on the device per layer and token, in units of (model dim, attention width, KV
    # width, FFN width), the layer's input included.
    widths: tuple[float, float, float, float]
    # Pipelines only (None: not offered there): the share of the layer's attention and of its
    # weight matmuls recomputed in a backward.
    recompute: tuple[int, int] | None = None
    # What it keeps beside on XLA's attention (cuDNN's keeps no (T, T) arrays): widths as
    # above, and bytes per token, head and key position (the scores, probabilities and mask),
    # counted in the compiled layer in bf16.
    xla_widths: tuple[float, float, float, float] = (0, 0, 0, 0)
    xla_scores: float = 0
    offloaded: tuple[str, ...] = ()  # The named activations it keeps in pinned host memory.
    # Policies that keep dropless MoE's named values ("experts"): per routed assignment, its
    # gate+up output (as the FFN widths count for a dense MLP) and these more values (moe_ffn_dim
    # wide, d_model wide): the weighted hidden rows and the sorted input rows.
    expert_rows: tuple[float, float] = (0, 0)


_policies = jax.checkpoint_policies
_both = _policies.save_from_both_policies
# dropless MoE's grouped matmuls (parallel/expert.py names them): not dot_general, so the dots
# policies would recompute them in the backward pass.
_experts = _policies.save_only_these_names("experts")
_dots_no_batch = _both(_policies.dots_with_no_batch_dims_saveable, _experts)


def _offloading(names) -> Remat:
    """The policy that keeps the activations `names` in pinned host memory and recomputes the
    rest (the layer input aside)."""
    policy = _policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[],
        names_which_can_be_offloaded=list(names),
        offload_src="device",
        offload_dst="pinned_host",
    )
    return Remat(policy, (1, 0, 0, 0), offloaded=tuple(names))


# The table's order breaks the remat choice's ties (`planning.activations.auto_order`): fastest
# first, where two recompute alike.
REMATS = {
    # Everything: the layer's input, norms' float32 intermediates (twice the values), Q, K, V,
    # the attention output, the MLP's four (M, F) values (and a bf16 cast of each weight when
    # the params are float32, which no per-token model counts).
    "none": Remat(None, (14, 2, 2, 6), xla_scores=11),
    # dots_no_batch's values, and on XLA's attention its batched dots: the float32 scores and
    # Q once more.
    "dots": Remat(
        _both(_policies.checkpoint_dots, _experts),
        (2, 1, 2, 2),
        xla_widths=(0, 1, 0, 0),
        xla_scores=4,
        expert_rows=(1, 1),
    ),
    # Also the attention's forward results (cuDNN's or a ring's; on XLA's attention without a
    # ring, the same as dots_no_batch): the layer input, Q, K, V, the attention output's
    # projection, the gate and up projections, and the attention output (its statistics are a
    # few bytes a head).
    "dots_attention": Remat(
        _both(_dots_no_batch, flash_attention_saveable), (2, 2, 2, 2), (0, 0), expert_rows=(1, 1)
    ),
    "dots_no_batch": Remat(_dots_no_batch, (2, 1, 2, 2), (1, 0), expert_rows=(1, 1)),
    # full's recompute, but the attention's forward results are kept (the layer input and
    # the attention output; cuDNN's statistics and the ring's log-sum-exp are a few bytes a
    # head): at long context, where attention outweighs the weight matmuls, nearly
    # dots_attention's speed at little more than full's memory.
    "attention": Remat(flash_attention_saveable, (1, 1, 0, 0), (0, 1)),
    "full": Remat(_policies.nothing_saveable, (1, 0, 0, 0), (1, 1)),
    # The weight-matmul outputs that dots_no_batch keeps, kept in pinned host memory instead.
    "offload_dots": _offloading(OFFLOADABLE),
}
# The layer policies a pipeline offers. Each keeps activations only (the residuals of every
# microbatch in flight are kept per slot; a policy that saved a cast of a weight would keep a
# copy of it per slot).
STAGE_REMATS = tuple(name for name, r in REMATS.items() if r.recompute is not None)


def has_attention_results(attention: str, context: int) -> bool:
    """Whether a layer has attention forward results for a policy to keep: cuDNN's attention
    (`attention` resolved), or a ring over `context` devices (its merged results are named)."""
    return attention == "cudnn" or context > 1


def kept(remat: str, attention_results: bool) -> str:
    """The entry whose values REMATS[remat] keeps: without attention forward results to keep
    (XLA's attention, no ring), dots_attention keeps what dots_no_batch does, and attention
    what full does."""
    if attention_results:
        return remat
    return {"dots_attention": "dots_no_batch", "attention": "full"}.get(remat, remat)


_input_to_host = _policies.save_and_offload_only_these_names(
    names_which_can_be_saved=[],
    names_which_can_be_offloaded=[LAYER_INPUT],
    offload_src="device",
    offload_dst="pinned_host",
)


@functools.cache
def layer_policy(remat: str, input_on_host: bool) -> Callable | None:
    """The checkpoint policy of a layer under REMATS[remat]; with `input_on_host`, the layer's
    input (named LAYER_INPUT) goes to pinned host memory in the forward pass and comes back in
    the backward, and the device keeps no copy (everything the layer recomputes derives from
    the named value)."""
    policy = REMATS[remat].policy
    if not input_on_host:
        return policy
    if policy is None:
        raise ValueError("a layer input in host memory needs remat (remat='none' keeps all)")

    def offloading(prim, *args, **params):
        if prim.name == "name" and params.get("name") == LAYER_INPUT:
            return _input_to_host(prim, *args, **params)
        return policy(prim, *args, **params)

    return offloading
