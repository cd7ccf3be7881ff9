"""Library kernels and the choice between them: grouped GEMMs for MoE experts (JAX's own
Pallas Mosaic GPU kernels or tokamax's), flash attention blocks for ring attention (cuDNN's
or tokamax's), or XLA's own ops.

Grouped GEMMs at moe_1b's expert shape (experiments/grouped_gemm.py): JAX's
`jax.experimental.pallas.ops.gpu` Hopper kernels (`ragged_dot_mgpu` for the forward and dX,
`transposed_ragged_dot_mgpu` for dW) reach about 0.9x a dense cuBLAS matmul of the same FLOPs,
over twice tokamax's; `lax.ragged_dot` under a tenth of it (XLA lowers it to dense matmuls
over every group on CUDA).
Ring attention's blocks need the log-sum-exp out of the forward and a backward that takes the
ring's merged output and log-sum-exp: cuDNN's fused attention has both (its forward
primitive's softmax statistics, its backward primitive given those residuals); tokamax's
Mosaic GPU flash kernels too, at 0.81-0.92 of cuDNN's TFLOP/s forward + backward
(experiments/attention_kernels.py).
Elsewhere (CPU, other GPUs, Python 3.11, float32) the XLA ops run; `config.model.moe_kernel`
(auto | jax_pallas | tokamax | xla) and `config.model.ring_blocks` (auto | cudnn | tokamax |
xla) choose, and `choose` says why auto fell back.
"""

import functools

import jax
import jax.numpy as jnp

from angel_jax import machine
from angel_jax.config import MOE_KERNELS, RING_KERNELS, ConfigError

F32 = jnp.float32
# Compute capabilities with tokamax's sm90 / sm100 Mosaic GPU kernels; JAX's grouped GEMMs
# are Hopper's (WGMMA).
_MOSAIC_GPUS = ("9.0", "10.0")
_HOPPER = "9.0"


def tokamax_missing() -> str | None:
    """Why tokamax's Mosaic GPU kernels cannot run here, or None if they can."""
    return _tokamax_missing(machine.backend(), _local_capability())


def jax_pallas_missing() -> str | None:
    """Why JAX's Hopper grouped GEMMs cannot run here, or None if they can."""
    return _jax_pallas_missing(machine.backend(), _local_capability())


def cudnn_missing() -> str | None:
    """Why cuDNN's fused attention cannot serve as ring blocks here, or None if it can: a
    described GPU's (angel_jax.machine) are traced without it, with JAX's CUDA plugin."""
    return _cudnn_missing(machine.backend(), machine.compute_capability())


def _local_capability() -> str:
    """This machine's GPU's: the Mosaic GPU kernels are traced on the GPU itself (JAX's
    grouped GEMMs read its SM count), so compile-only devices of a described GPU run XLA's
    grouped matmul, which compiles to other memory than the GPU's kernels."""
    return getattr(jax.devices()[0], "compute_capability", "?")


# Cached per machine: a described GPU (angel_jax.machine) is planned for after this one.
@functools.cache
def _tokamax_missing(backend: str, capability: str) -> str | None:
    if backend != "gpu":
        return f"no GPU (backend {backend})"
    if capability not in _MOSAIC_GPUS:
        return f"compute capability {capability} (its kernels need sm90 or sm100)"
    try:
        import tokamax  # noqa: F401
    except ImportError as e:
        return f"tokamax does not import ({e}; it needs Python >= 3.12 and jax >= 0.11.1)"
    return None


@functools.cache
def _jax_pallas_missing(backend: str, capability: str) -> str | None:
    if backend != "gpu":
        return f"no GPU (backend {backend})"
    if capability != _HOPPER:
        return f"compute capability {capability} (its kernels are Hopper's, sm90)"
    try:
        from jax.experimental.pallas.ops.gpu import (  # noqa: F401
            ragged_dot_mgpu,
            transposed_ragged_dot_mgpu,
        )
    except ImportError as e:
        return f"jax {jax.__version__} lacks them ({e})"
    return None


@functools.cache
def _cudnn_missing(backend: str, capability: str) -> str | None:
    if backend != "gpu":
        return f"no GPU (backend {backend})"
    try:
        _cudnn_attention().check_cudnn_version()
    except (ImportError, AttributeError, RuntimeError) as e:
        return f"cuDNN's fused attention is not usable from jax {jax.__version__} ({e})"
    if capability == "?" or float(capability) < 8.0:
        return f"compute capability {capability} (cuDNN's flash attention needs sm80 or later)"
    return None


@functools.cache
def cudnn_traceable() -> bool:
    """Whether this process can trace cuDNN's attention (JAX's CUDA plugin with cuDNN, GPU or
    not)."""
    try:
        from jax._src.cudnn import fused_attention_stablehlo as fused

        fused.check_cudnn_version()
    except (ImportError, AttributeError, RuntimeError):
        return False
    return True


def traced_attention(implementation: str) -> str:
    """The attention a layer traces for `implementation`: XLA's in place of cuDNN's where this
    process cannot trace cuDNN's, which happens only when it plans for a GPU it does not have
    (machine.describe) and needs the shapes alone; the memory model reads the setting, not
    this."""
    if implementation == "cudnn" and not cudnn_traceable():
        return "xla"
    return implementation


def resolve_attention(model, backend: str) -> str:
    """config.model.attention (`model`: config.model) with auto resolved: cudnn on a GPU in a
    16-bit dtype, else xla."""
    attention = model.attention
    if attention == "auto":
        attention = "cudnn" if backend == "gpu" and model.dtype != "float32" else "xla"
    if attention == "cudnn" and (backend != "gpu" or model.dtype == "float32"):
        raise ConfigError(
            f"config.model.attention=cudnn needs a GPU and a 16-bit config.model.dtype "
            f"(here {backend}, {model.dtype}); use attention=auto or xla"
        )
    return attention


def shape_misfits(setting: str, model) -> dict[str, str]:
    """The library kernels for config.model.<setting> that `model`'s shapes (config.model)
    rule out, with why: JAX's Hopper grouped GEMMs tile both matmul widths by 128."""
    widths = (model.d_model, model.moe_ffn_dim or model.ffn_dim)
    if setting == "moe_kernel" and any(w % 128 for w in widths):
        return {
            "jax_pallas": f"d_model={widths[0]} and moe_ffn_dim={widths[1]}: its kernels "
            "need multiples of 128"
        }
    return {}


def choose(
    setting: str, value: str, dtype: str, misfits: dict[str, str] | None = None
) -> tuple[str, str | None]:
    """(kernel, note) for config.model.<setting> = value in compute dtype `dtype`: a library
    kernel or `xla`, and for an auto that fell back on a GPU the line that says so. auto takes
    the fastest that runs: for the grouped GEMMs JAX's, then tokamax's; for the ring's blocks
    cuDNN's, then tokamax's. `misfits`: kernels the model's shapes rule out (`shape_misfits`)."""
    choices = MOE_KERNELS if setting == "moe_kernel" else RING_KERNELS
    if value not in choices:
        raise ConfigError(f"config.model.{setting}={value!r}: use {', '.join(choices)}")
    libraries = [k for k in choices if k not in ("auto", "xla")]
    checks = {"jax_pallas": jax_pallas_missing, "tokamax": tokamax_missing, "cudnn": cudnn_missing}
    missing = {}
    for kernel in libraries:
        missing[kernel] = checks[kernel]()
        if missing[kernel] is None and dtype not in ("bfloat16", "float16"):
            missing[kernel] = f"config.model.dtype={dtype} (its kernels take bf16 or fp16)"
        if missing[kernel] is None:
            missing[kernel] = (misfits or {}).get(kernel)
    if value in missing and missing[value]:
        raise ConfigError(
            f"config.model.{setting}={value} needs its GPU kernels, which cannot run "
            f"here: {missing[value]}; use {setting}=auto or xla"
        )
    if value != "auto":
        return value, None
    for kernel in libraries:
        if missing[kernel] is None:
            return kernel, None
    note = None
    if machine.backend() == "gpu":
        why = "; ".join(f"{k}: {missing[k]}" for k in libraries)
        note = f"config.model.{setting}=auto runs XLA's kernel, not a library's ({why})"
    return "xla", note


def ragged_dot(x_MK, w_GKN, sizes_G, kernel: str, every_row: bool = False):
    """Grouped matmul (M, N): rows of x in consecutive groups of `sizes`, group g times w[g].
    Rows past sum(sizes) are zero and get zero gradient: the library kernels leave them
    unwritten, in the output and in their backward's dx. `every_row`: the caller knows the
    groups cover all M rows, so no masking (two passes over (M, K) and (M, N) saved)."""
    if every_row:
        return _ragged_dot(x_MK, w_GKN, sizes_G, kernel)
    grouped = (jnp.arange(x_MK.shape[0]) < jnp.sum(sizes_G))[:, None]
    x_MK = jnp.where(grouped, x_MK, jnp.zeros((), x_MK.dtype))
    out = _ragged_dot(x_MK, w_GKN, sizes_G, kernel)
    return jnp.where(grouped, out, jnp.zeros((), out.dtype))


def _ragged_dot(x_MK, w_GKN, sizes_G, kernel: str):
    if kernel == "jax_pallas":
        return _hopper_ragged_dot(x_MK, w_GKN, sizes_G)
    if kernel == "tokamax":
        import tokamax

        # One implementation named, so a kernel that cannot run fails loudly rather than
        # falling back to another inside tokamax.
        return tokamax.ragged_dot(x_MK, w_GKN, sizes_G, implementation="mosaic")
    return jax.lax.ragged_dot(x_MK, w_GKN, sizes_G)


# Tiles of JAX's Hopper grouped GEMMs, the fastest of a sweep at moe_1b's shapes
# (experiments/grouped_gemm.py): 192 x 128 output tiles for the forward and dX (5% over
# 128 x 128; 128 x 256 and 256 x 128 ran under a third as fast), 128 x 128 for dW.
_ROWS_TILE = dict(block_m=192, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=8)
_WEIGHTS_TILE = dict(block_m=128, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=8)


# Each kernel under its own jit: a program with unrolled layers then lowers each kernel once
# and calls it from every layer (JAX caches a jit's lowering within a module); inline, the
# Mosaic GPU lowering ran again for every call (moe_1b unrolled took over 5x as long to
# compile).
@functools.partial(jax.jit, static_argnames="transpose_rhs")
def _rows_kernel(x_MK, w_GKN, sizes_G, transpose_rhs=False):
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    return ragged_dot_mgpu.ragged_dot(
        x_MK, w_GKN, group_sizes=sizes_G, transpose_rhs=transpose_rhs, **_ROWS_TILE
    )


@jax.jit
def _weights_kernel(x_MK, dout_MN, sizes_G):
    from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu

    return transposed_ragged_dot_mgpu.transposed_ragged_dot(
        x_MK, dout_MN, group_sizes=sizes_G, **_WEIGHTS_TILE
    )


@jax.custom_vjp
def _hopper_ragged_dot(x_MK, w_GKN, sizes_G):
    k, n = w_GKN.shape[1:]
    if k % 128 or n % 128:  # dW's tiles are 128 x 128 over (K, N); the others need K % 64.
        raise ConfigError(
            f"config.model.moe_kernel=jax_pallas: a grouped matmul of {k} -> {n} features; "
            "its kernels need both multiples of 128 (d_model and moe_ffn_dim): change them or "
            "use moe_kernel=tokamax or xla"
        )
    return _rows_kernel(x_MK, w_GKN, sizes_G)


def _hopper_ragged_dot_fwd(x_MK, w_GKN, sizes_G):
    return _hopper_ragged_dot(x_MK, w_GKN, sizes_G), (x_MK, w_GKN, sizes_G)


def _hopper_ragged_dot_bwd(residuals, dout_MN):
    x_MK, w_GKN, sizes_G = residuals
    dout_MN = dout_MN.astype(x_MK.dtype)
    # dX = dout @ w[g]^T: w as stored is the transposed right-hand side.
    dx = _rows_kernel(dout_MN, w_GKN, sizes_G, transpose_rhs=True)
    # dW[g] = x_g^T dout_g over each group's rows (zero for an empty group).
    dw = _weights_kernel(x_MK, dout_MN, sizes_G)
    return dx, dw.astype(w_GKN.dtype), None


_hopper_ragged_dot.defvjp(_hopper_ragged_dot_fwd, _hopper_ragged_dot_bwd)


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


def tokamax_block(q, k, v, causal: bool, ops=None):
    """`xla_block` through tokamax's Mosaic GPU flash forward, which returns the softmax's
    row max and denominator beside the normalised output. `ops`: tokamax's (forward,
    backward) ops to use, configured; None: their defaults."""
    forward, _ = ops or _tokamax_attention()
    out, (row_max, denominator) = forward(
        _flat_heads(q), k, v, is_causal=causal, return_residuals=True
    )
    lse = (row_max + jnp.log(denominator)).reshape(q.shape[0], *q.shape[2:4], q.shape[1])
    return out.reshape(q.shape), lse  # The output in q's dtype: the ring's merge widens it.


def tokamax_block_grads(q, k, v, do, out, lse, causal: bool, ops=None):
    """`xla_block_grads` through tokamax's Mosaic GPU flash backward. Its kernels form the
    probabilities as exp(s - max) / denominator from the residuals given, so passing the
    merged lse as the max and 1 as the denominator (and the merged output, from which it
    takes delta) yields this block's share of the full softmax's gradient. `ops`: as
    `tokamax_block`'s."""
    forward, backward = ops or _tokamax_attention()
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


@functools.cache
def _cudnn_attention():
    """JAX's cuDNN fused attention module. The blocks bind its core primitives (the forward's,
    and the backward's that takes residuals from outside), which are not public API:
    cudnn_missing() turns their absence into a fallback that says so."""
    from jax._src.cudnn import fused_attention_stablehlo as fused

    fused._dot_product_attention_fwd_impl, fused._dot_product_attention_bwd_impl  # noqa: B018
    return fused


def _cudnn_settings(fused, q, causal: bool) -> dict:
    """What a block's cuDNN forward and backward share: its mask and scale, and no bias,
    sequence lengths, offsets, page tables or dropout.

    They go to cuDNN's core primitives, not to the custom-partitioned wrappers that JAX's
    public attention binds: a block runs on each device's own chunks inside the ring's
    shard_map, with nothing to partition. The operands it does without are zero-size slices
    of q, not constants: with `jnp.zeros(0)` in their place (what JAX's public attention
    passes) XLA (jax 0.11.2) crashed compiling the two-GPU ring step of a scanned layer stack,
    in Shardy's ManualComputationUnusedInputsPattern; with the slices it compiles."""
    mask = fused.MaskType.CAUSAL if causal else fused.MaskType.NO_MASK
    unused = q.reshape(-1)[:0]
    return dict(
        bias=unused,
        q_seqlen=unused,
        kv_seqlen=unused,
        q_offsets=unused,
        kv_offsets=unused,
        page_table_k=unused,
        page_table_v=unused,
        scale=q.shape[-1] ** -0.5,
        mask_type=mask,
        seed=42,
        dropout_rate=0.0,
        variadic_args=(False, False),  # (has bias, has bias gradient)
        layout=fused.AttentionLayout.BTNH.value,
        sliding_window_length=None,
    )


def cudnn_block(q, k, v, causal: bool):
    """`xla_block` through cuDNN's flash forward; its residual is the log-sum-exp, float32,
    (B, N, T) with a KV head's query heads adjacent."""
    fused = _cudnn_attention()
    out, lse = fused._dot_product_attention_fwd_impl(
        _flat_heads(q), k, v, **_cudnn_settings(fused, q, causal), is_training=True
    )
    return out.reshape(q.shape), lse.reshape(q.shape[0], *q.shape[2:4], q.shape[1])


def cudnn_block_grads(q, k, v, do, out, lse, causal: bool):
    """`xla_block_grads` through cuDNN's flash backward: it forms the probabilities as
    exp(s - lse) and delta from the output it is given, so the ring's merged output and lse
    yield this block's share of the full softmax's gradient."""
    fused = _cudnn_attention()
    dq, dk, dv = fused._dot_product_attention_bwd_impl(
        _flat_heads(q),
        k,
        v,
        activation=lse.reshape(lse.shape[0], -1, lse.shape[-1]).astype(F32),
        fwd_output=_flat_heads(out).astype(q.dtype),
        grad_output=_flat_heads(do).astype(q.dtype),
        **_cudnn_settings(fused, q, causal),
    )
    return dq.reshape(q.shape), dk, dv  # In q's dtype.


RING_BLOCKS = {
    "xla": (xla_block, xla_block_grads),
    "cudnn": (cudnn_block, cudnn_block_grads),
    "tokamax": (tokamax_block, tokamax_block_grads),
}


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
            kernel, note = choose(
                setting, model[setting], model.dtype, shape_misfits(setting, model)
            )
            parts.append(f"{what} {kernel}")
            notes += [f"note: {note}"] if note else []
    return ([f"kernels: {', '.join(parts)}"] if parts else []) + notes
