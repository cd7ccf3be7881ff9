"""Library kernels and the choice between them: tokamax's Mosaic GPU grouped GEMM (MoE experts)
and flash attention blocks (ring attention), or XLA's own ops.

tokamax (PyPI `tokamax`, Python >= 3.12, jax >= 0.11.1; tested on 0.11.2) has Pallas Mosaic
GPU kernels for Hopper and newer. On one H200 its grouped GEMM ran 246 TFLOP/s forward +
backward where `lax.ragged_dot` ran 40 (XLA lowers it to dense matmuls over every group on
CUDA; experiments/results/grouped_gemm.json), and its flash attention blocks 0.81-0.92 of
cuDNN's (attention_kernels.json). Elsewhere (CPU, older GPUs, Python 3.11, float32) the XLA ops
run; `config.model.moe_kernel` and `config.model.ring_blocks` choose (auto | tokamax | xla),
and `choose` says why auto fell back.
"""

import functools

import jax
import jax.numpy as jnp

from angel_jax.config import KERNELS, ConfigError

F32 = jnp.float32
# Compute capabilities with tokamax's sm90 / sm100 Mosaic GPU kernels.
_MOSAIC_GPUS = ("9.0", "10.0")


@functools.cache
def tokamax_missing() -> str | None:
    """Why tokamax's Mosaic GPU kernels cannot run here, or None if they can."""
    if jax.default_backend() != "gpu":
        return f"no GPU (backend {jax.default_backend()})"
    capability = getattr(jax.devices()[0], "compute_capability", "?")
    if capability not in _MOSAIC_GPUS:
        return f"compute capability {capability} (its kernels need sm90 or sm100)"
    try:
        import tokamax  # noqa: F401
    except ImportError as e:
        return f"tokamax does not import ({e}; it needs Python >= 3.12 and jax >= 0.11.1)"
    return None


def choose(setting: str, value: str, dtype: str) -> tuple[str, str | None]:
    """(kernel, note) for config.model.<setting> = value in compute dtype `dtype`: `tokamax`
    or `xla`, and for an auto that fell back on a GPU the line that says so."""
    if value not in KERNELS:
        raise ConfigError(f"config.model.{setting}={value!r}: use {', '.join(KERNELS)}")
    missing = tokamax_missing()
    if missing is None and dtype not in ("bfloat16", "float16"):
        missing = f"config.model.dtype={dtype} (its kernels take bf16 or fp16)"
    if value == "tokamax" and missing:
        raise ConfigError(
            f"config.model.{setting}=tokamax needs tokamax's Mosaic GPU kernels, which cannot "
            f"run here: {missing}; use {setting}=auto or xla"
        )
    if value != "auto":
        return value, None
    if missing is None:
        return "tokamax", None
    note = None
    if jax.default_backend() == "gpu":
        note = f"config.model.{setting}=auto runs XLA's kernel, not tokamax's: {missing}"
    return "xla", note


def ragged_dot(x_MK, w_GKN, sizes_G, kernel: str):
    """Grouped matmul (M, N): rows of x in consecutive groups of `sizes`, group g times w[g].
    Rows past sum(sizes) are zero and get zero gradient: tokamax leaves them unwritten, in the
    output and in its backward's dx."""
    grouped = (jnp.arange(x_MK.shape[0]) < jnp.sum(sizes_G))[:, None]
    x_MK = jnp.where(grouped, x_MK, jnp.zeros((), x_MK.dtype))
    if kernel == "tokamax":
        import tokamax

        # One implementation named, so a kernel that cannot run fails loudly rather than
        # falling back to another inside tokamax.
        out = tokamax.ragged_dot(x_MK, w_GKN, sizes_G, implementation="mosaic")
    else:
        out = jax.lax.ragged_dot(x_MK, w_GKN, sizes_G)
    return jnp.where(grouped, out, jnp.zeros((), out.dtype))


# Flash attention blocks for ring attention. A block is one (query chunk, key chunk) pair,
# either fully visible or causal with the chunks aligned (query i sees keys 0..i); the ring
# cuts its zigzag chunk pairs into such blocks. Shapes as in parallel/attention.py: q (B, T, K,
# G, H), k and v (B, S, K, H); lse (B, K, G, T).


def xla_block(q, k, v, causal: bool):
    """(out (B, T, K, G, H), lse f32 (B, K, G, T)) of q against k, v: out in float32 here,
    in q's dtype from tokamax (the ring widens it)."""
    scale = q.shape[-1] ** -0.5
    s = jnp.einsum("bqkgh,bskh->bkgqs", q, k, preferred_element_type=F32) * scale
    if causal:
        s = jnp.where(jnp.tri(q.shape[1], k.shape[1], dtype=bool), s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)
    p = jnp.exp(s - lse[..., None])
    out = jnp.einsum("bkgqs,bskh->bqkgh", p.astype(v.dtype), v, preferred_element_type=F32)
    return out, lse


def xla_block_grads(q, k, v, do, out, lse, causal: bool):
    """(dq, dk, dv) of one block (float32 here, q's dtype from tokamax), given the output and
    lse of these queries over ALL keys (the ring's merged ones): the block's share of the full
    softmax's gradient."""
    scale = q.shape[-1] ** -0.5
    delta = jnp.einsum("bqkgh,bqkgh->bkgq", do.astype(F32), out.astype(F32))
    s = jnp.einsum("bqkgh,bskh->bkgqs", q, k, preferred_element_type=F32) * scale
    if causal:
        s = jnp.where(jnp.tri(q.shape[1], k.shape[1], dtype=bool), s, -jnp.inf)
    p = jnp.exp(s - lse[..., None])
    dv = jnp.einsum("bkgqs,bqkgh->bskh", p.astype(do.dtype), do, preferred_element_type=F32)
    dp = jnp.einsum("bqkgh,bskh->bkgqs", do, v, preferred_element_type=F32)
    ds = p * (dp - delta[..., None]) * scale
    dq = jnp.einsum("bkgqs,bskh->bqkgh", ds, k.astype(F32))
    dk = jnp.einsum("bkgqs,bqkgh->bskh", ds, q.astype(F32))
    return dq, dk, dv


def _flat_heads(x):
    """(B, T, K, G, H) -> (B, T, K*G, H): tokamax's layout, query heads of a KV head adjacent."""
    return x.reshape(*x.shape[:2], -1, x.shape[-1])


@functools.cache
def _tokamax_attention():
    from tokamax._src.ops.attention import pallas_mosaic_gpu, pallas_mosaic_gpu_vjp

    return (
        pallas_mosaic_gpu.PallasMosaicGpuFlashAttention(),
        pallas_mosaic_gpu_vjp.PallasMosaicGpuFlashAttentionVjp(),
    )


def tokamax_block(q, k, v, causal: bool):
    """`xla_block` through tokamax's Mosaic GPU flash forward, which returns the softmax's
    row max and denominator beside the normalised output."""
    forward, _ = _tokamax_attention()
    out, (row_max, denominator) = forward(
        _flat_heads(q), k, v, is_causal=causal, return_residuals=True
    )
    lse = (row_max + jnp.log(denominator)).reshape(q.shape[0], *q.shape[2:4], q.shape[1])
    return out.reshape(q.shape), lse  # The output in q's dtype: the ring's merge widens it.


def tokamax_block_grads(q, k, v, do, out, lse, causal: bool):
    """`xla_block_grads` through tokamax's Mosaic GPU flash backward. Its kernels form the
    probabilities as exp(s - max) / denominator from the residuals given, so passing the
    merged lse as the max and 1 as the denominator (and the merged output, from which it
    takes delta) yields this block's share of the full softmax's gradient."""
    forward, backward = _tokamax_attention()
    flat_q, flat_do = _flat_heads(q), _flat_heads(do)
    lse = lse.reshape(lse.shape[0], -1, lse.shape[-1])  # (B, K*G, T)
    bound = forward.bind(flat_q, k, v, is_causal=causal).kwargs
    grads = backward(
        (lse, jnp.ones_like(lse)),
        _flat_heads(out).astype(q.dtype),
        flat_do.astype(q.dtype),
        flat_q,
        k,
        v,
        **bound,
    )
    return grads["q"].reshape(q.shape), grads["k"], grads["v"]  # In q's dtype.


RING_BLOCKS = {"xla": (xla_block, xla_block_grads), "tokamax": (tokamax_block, tokamax_block_grads)}


def banner(model, ring: bool) -> list[str]:
    """Startup lines for the kernels a run uses (config.model `model`; `ring`: ring attention
    runs): which of them runs, and a note for each auto that fell back on a GPU."""
    uses = (
        ("ring_blocks", "ring attention blocks", ring),
        ("moe_kernel", "MoE grouped GEMMs", model.num_experts and model.router == "dropless"),
    )
    parts, notes = [], []
    for setting, what, used in uses:
        if used:
            kernel, note = choose(setting, model[setting], model.dtype)
            parts.append(f"{what} {kernel}")
            notes += [f"note: {note}"] if note else []
    return ([f"kernels: {', '.join(parts)}"] if parts else []) + notes
