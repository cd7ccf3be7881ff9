"""Attention TFLOP/s, forward and forward + backward: our Pallas flash block kernels beside
cuDNN's, per sequence length.

    python experiments/attention_kernels.py [--lengths 2048,8192,32768] [--out FILE]

Causal, bf16, 32 heads of 64, about 16k tokens per call (B = 16384 / T); FLOPs counted on the
causal half for both: 4 * B * T * T * N * H / 2 forward, 2.5 times that more for the backward
(its five matmuls against the forward's two).
"""

import argparse
import json
import sys
import time

from throughput import ROOT, write_results


def timed(fn, *args, reps=10) -> float:
    import jax

    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    for _ in range(reps):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / reps


def pallas_forward(q, k, v):
    """Our kernel on (B, T, N, H) inputs, causal over positions 0..T-1."""
    import jax.numpy as jnp

    from kernels_pallas.flash_block import flash_block_forward

    pos = jnp.arange(q.shape[1])
    heads_major = lambda x: x.transpose(0, 2, 1, 3)
    return flash_block_forward(*map(heads_major, (q, k, v)), pos, pos, causal=True)[0]


def pallas_forward_backward(q, k, v, do):
    """Our forward and backward kernels (dQ, dK, dV), as ring attention's block step runs them."""
    import jax.numpy as jnp

    from kernels_pallas.flash_block import flash_block_backward, flash_block_forward

    pos = jnp.arange(q.shape[1])
    q, k, v, do = (x.transpose(0, 2, 1, 3) for x in (q, k, v, do))
    out, lse = flash_block_forward(q, k, v, pos, pos, causal=True)
    delta = jnp.sum(do.astype(jnp.float32) * out, axis=-1)
    return flash_block_backward(q, k, v, do, lse, delta, pos, pos, causal=True)


def cudnn_forward_backward(q, k, v, do):
    import jax

    attention = lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=True, implementation="cudnn"
    )
    out, vjp = jax.vjp(attention, q, k, v)
    return vjp(do)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--lengths", default="2048,8192,32768")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--out", default=str(ROOT / "experiments/results/attention_kernels.json"))
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    import jax
    import jax.numpy as jnp

    results = []
    for t in map(int, args.lengths.split(",")):
        b, n, h = max(1, 16384 // t), args.heads, args.head_dim
        keys = jax.random.split(jax.random.key(0), 4)
        q, k, v, do = (jax.random.normal(key, (b, t, n, h), jnp.bfloat16) for key in keys)
        flops = 4 * b * t * t * n * h / 2
        row = dict(batch=b, seq_len=t, heads=n, head_dim=h)
        cudnn = jax.jit(
            lambda q, k, v: jax.nn.dot_product_attention(
                q, k, v, is_causal=True, implementation="cudnn"
            )
        )
        runs = (
            ("cudnn", cudnn, (q, k, v), flops),
            ("pallas", jax.jit(pallas_forward), (q, k, v), flops),
            ("cudnn_fwd_bwd", jax.jit(cudnn_forward_backward), (q, k, v, do), 3.5 * flops),
            ("pallas_fwd_bwd", jax.jit(pallas_forward_backward), (q, k, v, do), 3.5 * flops),
        )
        for name, fn, args_, work in runs:
            try:
                row[f"{name}_tflops"] = work / timed(fn, *args_) / 1e12
            except Exception as e:  # noqa: BLE001 - a kernel that fails to compile is a result.
                row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        results.append(row)
        print(json.dumps(row), flush=True)
    names = ("cudnn", "pallas", "cudnn_fwd_bwd", "pallas_fwd_bwd")
    print(f"\nTFLOP/s\n{'seq_len':>8} {'batch':>6}", *(f"{n:>15}" for n in names))
    for r in results:
        cells = [f"{r[f'{n}_tflops']:.1f}" if f"{n}_tflops" in r else "failed" for n in names]
        print(f"{r['seq_len']:>8} {r['batch']:>6}", *(f"{c:>15}" for c in cells))
    write_results(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
