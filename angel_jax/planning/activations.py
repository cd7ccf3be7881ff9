"""The activations a layer keeps for its backward pass under each remat policy, on one device
(`activation_bytes`), and the remat choice: the policies config.model.remat=auto tries, fastest
first (`remat_choices`), and with the layer inputs' tier (`inputs_and_remats`). The policies
themselves are the table in angel_jax/remat.py.
"""

import math

import numpy as np

from angel_jax.family import DecoderShape
from angel_jax.mesh import CONTEXT, DATA, EXPERT, SEQUENCE, TENSOR
from angel_jax.planning.inputs import PlanInput
from angel_jax.planning.memory import per_device_widths, saved_values
from angel_jax.planning.tiers import HOST
from angel_jax.remat import REMATS, STAGE_REMATS, has_attention_results, kept

# A recomputing layer's backward temporaries per token, in (d_model, ffn_dim) values.
WORKING_WIDTHS = (8, 6)
# What config.model.remat=auto tries (`auto_order`): the pipeline's policies. Not none:
# keeping every value was slower than dots_no_batch, at twice the memory: the saved values'
# traffic outweighs the recompute they spare.
AUTO_REMATS = STAGE_REMATS


def auto_order(
    attention_results: bool, matmul_flops: float, attention_flops: float
) -> tuple[str, ...]:
    """AUTO_REMATS fastest first: those that keep something of their own here, by the forward
    FLOPs their backward pass recomputes per token and layer (`matmul_flops` of the weight
    matmuls, `attention_flops` of the attention), the table's order breaking ties. At long
    context, where attention outweighs the matmuls, attention comes before dots_no_batch."""
    own = [r for r in AUTO_REMATS if kept(r, attention_results) == r]
    return tuple(sorted(own, key=lambda r: recomputed(r, matmul_flops, attention_flops)))


def recomputed(remat: str, matmul_flops: float, attention_flops: float) -> float:
    """The forward FLOPs a layer's backward pass recomputes per token under REMATS[remat]
    (one of AUTO_REMATS), of `matmul_flops` of weight matmuls and `attention_flops` of
    attention."""
    return float(np.dot(REMATS[remat].recompute, (attention_flops, matmul_flops)))


def activation_bytes(inp: PlanInput, remat: str) -> dict[str, int]:
    """Per-device bytes of saved activations under REMATS[remat] (memory.saved_values): "layer
    inputs" (exact: the residual stream entering each layer), "activations" (the rest the
    remat policy keeps on the device, with what one layer's recomputing backward holds and the
    float32 logits and their gradient, one of `logits_chunks` slices at a time) and
    "offloaded activations" (what it keeps in host memory)."""
    m, t, mesh = inp.model, inp.train, inp.mesh
    # Batch splits over data and expert, positions over context and sequence.
    splits = math.prod(mesh[a] for a in (DATA, EXPERT, CONTEXT, SEQUENCE))
    tokens = t.batch_size // t.microbatches * t.seq_len / splits
    itemsize, tensor = np.dtype(m.dtype).itemsize, mesh[TENSOR]
    # A token's MLP width: its experts' (routed and shared) in a mixture of experts.
    ffn, routed = m.ffn_dim, 0.0
    if m.num_experts:
        f, k, policy = m.moe_ffn_dim or m.ffn_dim, m.experts_per_token, REMATS[remat]
        ffn = (k + m.shared_experts) * f
        if m.router == "dropless" and any(policy.expert_rows):
            # Beyond the FFN widths of a token's k routed rows: dropless keeps rows for its
            # expert group's assignments (each rank gathers the group's tokens), and their
            # weighted hidden rows and sorted input rows too.
            group, (hidden, inputs) = mesh[EXPERT], policy.expert_rows
            keeps = ((policy.widths[3] + hidden) * f / tensor + inputs * m.d_model) * group
            routed = (keeps - policy.widths[3] * f / tensor) * k
    widths = per_device_widths(
        m.d_model, m.num_heads, m.num_kv_heads, m.head_dim, ffn, tensor, m.sequence_parallel
    )
    xla_keys = 0  # On XLA's attention some policies keep (T, T) arrays per head.
    if m.attention == "xla":
        xla_keys = m.num_heads / (tensor * mesh[SEQUENCE]) * t.seq_len / mesh[CONTEXT]
    on_device, on_host = saved_values(
        kept(remat, keeps_attention_results(inp)), widths, xla_keys, itemsize
    )
    per_value = m.num_layers * tokens * itemsize  # Bytes of one value per token and layer.
    logits = 2 * tokens * m.vocab_size * 4 / tensor / m.logits_chunks
    working = 0
    if remat != "none":
        # One layer's backward holds what it recomputes: about 8 d_model-wide and 6 ffn-wide
        # values per token (with their grads), the latter per MLP slice. Fitted to llama_1b's
        # step compiled for a GPU at 524k tokens, full remat.
        width = WORKING_WIDTHS[0] * m.d_model + WORKING_WIDTHS[1] * ffn / m.mlp_chunks
        working = tokens * width * itemsize / tensor
    # Unrolled layers: the LM head's backward frees the logits and their gradient before the
    # last layer's backward makes its working set, so the temporaries peak with one or the
    # other beside the saved values (moe_1b's step compiled for a GPU peaks at the
    # backward's start: the saved values and the logits). Scanned layers keep the sum (as
    # fitted): their backward's start allocates the stacked grads beside the saved values.
    transient = working + logits if m.scan_layers else max(working, logits)
    return {
        "layer inputs": int(per_value * widths[0]),
        "activations": int(per_value * (on_device + routed - widths[0]) + transient),
        "offloaded activations": int(per_value * on_host),
    }


def remat_choices(inp: PlanInput) -> tuple[str, ...]:
    """The remat policies a plan may take: config.model.remat's, or with auto AUTO_REMATS
    fastest first (`auto_order`: by what their backward pass
    recomputes at this sequence length), without dots_attention and attention where there are
    no attention results of cuDNN's or a ring's to keep (there they keep what dots_no_batch
    and full do)."""
    if inp.model.remat != "auto":
        return (inp.model.remat,)
    return auto_order(keeps_attention_results(inp), *layer_flops(inp.decoder, inp.train.seq_len))


def layer_flops(cfg: DecoderShape, seq_len: int) -> tuple[float, float]:
    """(weight matmuls', attention's) forward FLOPs of one layer per token."""
    return 2 * cfg.layer_matmul_params(), cfg.layer_attention_flops(seq_len)


# What a byte of a layer input's copies to host memory and back costs a step, in FLOPs of
# recompute: a GPU's matmul rate over its host link's (about 800 TFLOP/s against 50 GB/s each
# way), doubled for a margin in the device's favour, whose plans leave the pinned pool alone
# (the first step with inputs in host memory pays once, about 20 s, to grow the pool). At
# short context the copies and the recompute they spare cost about the same; at 262,144
# tokens `attention` with the inputs in host memory ran 1.26x `full` on the device, the
# copies 0.3% of its step.
FLOPS_PER_COPIED_BYTE = 2 * 805e12 / 50e9


def inputs_and_remats(inp: PlanInput, tiers, remats) -> list[tuple[str, str]]:
    """The (layer inputs' tier, remat) pairs a plan tries, fastest first: with remat auto,
    by the forward FLOPs the backward pass recomputes per token and layer plus, for inputs in
    host memory, their copies' cost (FLOPS_PER_COPIED_BYTE); ties keep the device first. At
    short context the device's tier comes first with every remat; at long context, where the
    attention forward outweighs the copies, attention with its inputs in host memory comes
    before full on the device (llama_1b from about 64k tokens: there 0.27 GFLOP a token and
    layer of causal attention, against 8 KiB of copies, 0.26 GFLOP at that rate)."""
    pairs = [(tier, r) for tier in tiers for r in remats]
    if len(tiers) == 1 or len(remats) == 1:
        return pairs
    flops, m = layer_flops(inp.decoder, inp.train.seq_len), inp.model
    copies = 2 * m.d_model * np.dtype(m.dtype).itemsize * FLOPS_PER_COPIED_BYTE
    cost = lambda pair: recomputed(pair[1], *flops) + (copies if pair[0] == HOST else 0)
    return sorted(pairs, key=cost)


def keeps_attention_results(inp: PlanInput) -> bool:
    """Whether the attention's forward results are there for a remat policy to keep on the
    mesh: cuDNN's attention, or a ring (its merged results are named)."""
    return has_attention_results(inp.model.attention, inp.mesh[CONTEXT])
