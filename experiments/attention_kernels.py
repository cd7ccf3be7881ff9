"""Attention TFLOP/s, forward and forward + backward: ring attention's block kernels
(angel_jax/kernels.py: cuDNN's fused attention with outside residuals, tokamax's Mosaic GPU
flash kernels) beside cuDNN's own attention, per shape.

    python experiments/attention_kernels.py [--shapes 2048:64,8192:64,32768:64,8192:128]
        [--blocks cudnn,tokamax]

Shapes are sequence length : head dim; causal, bf16, 32 query heads and 4 KV heads, about 16k
tokens per call (B = 16384 / T). The ring block is one causal block over the whole sequence,
run as the ring runs it: the forward returning its log-sum-exp, the backward taking the
output and log-sum-exp from outside. `ring_diagonal` is the ring's step-0 work on one rank,
the zigzag pair of chunks cut into three blocks (two causal, one full). FLOPs counted on the
causal half for all: 4 * B * T * T * N * H / 2 forward, 2.5 times that more for the backward
(its five matmuls against the forward's two). Each row also counts the compiled programs'
custom calls (`*_kernels`), to show which kernels ran.

    python experiments/attention_kernels.py --vjp-configs [--shapes ...] [--out FILE]

times the ring block's forward + backward instead under each of tokamax's sm90 backward
configs (its autotuning space, and the heuristic that angel_jax/kernels.py gets), causal and
full, beside cuDNN's causal or full attention.
"""

import argparse
import functools
import json
import sys

from throughput import ROOT, custom_calls, timed, write_results


def grouped(x, kv_heads):
    """(B, T, N, H) -> the ring's (B, T, K, G, H)."""
    b, t, n, h = x.shape
    return x.reshape(b, t, kv_heads, n // kv_heads, h)


def ring_block_forward(q, k, v, blocks):
    from angel_jax.kernels import RING_BLOCKS

    return RING_BLOCKS[blocks][0](grouped(q, k.shape[2]), k, v, True)


def ring_block_forward_backward(q, k, v, do, blocks):
    from angel_jax.kernels import RING_BLOCKS

    forward, backward = RING_BLOCKS[blocks]
    q, do = grouped(q, k.shape[2]), grouped(do, k.shape[2])
    out, lse = forward(q, k, v, True)
    return backward(q, k, v, do, out, lse, True)


def ring_diagonal_forward_backward(q, k, v, do, blocks):
    """The ring's diagonal step through its own code: a one-rank ring over the sequence."""
    import jax
    from jax.sharding import PartitionSpec as P

    from angel_jax.parallel.attention import ring_attention_local

    mesh = jax.make_mesh((1,), ("context",), axis_types=(jax.sharding.AxisType.Auto,))
    ring = jax.shard_map(
        lambda q, k, v: ring_attention_local(q, k, v, "context", True, blocks),
        mesh=mesh,
        in_specs=P(),
        out_specs=P(),
        check_vma=False,
    )
    _, vjp = jax.vjp(ring, grouped(q, k.shape[2]), k, v)
    return vjp(grouped(do, k.shape[2]))


def cudnn_forward_backward(q, k, v, do):
    import jax

    attention = lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=True, implementation="cudnn"
    )
    out, vjp = jax.vjp(attention, q, k, v)
    return vjp(do)


# (block_q, block_kv, num_stages, compute_wgs) of tokamax's sm90 flash backward; the first is
# its heuristic's (what runs without a config).
VJP_CONFIGS = [(64, 64, 2, 2), (64, 64, 3, 2), (128, 64, 2, 2), (128, 64, 3, 2), (64, 64, 2, 1)]
VJP_CONFIGS += [(128, 128, 2, 2), (64, 128, 2, 2)]


def sweep_vjp_configs(shapes: str, heads: int, kv_heads: int) -> list[dict]:
    """forward + backward TFLOP/s of the ring block per tokamax backward config, causal and
    full, with cuDNN's beside."""
    import jax
    import jax.numpy as jnp
    from tokamax._src.ops.attention import pallas_mosaic_gpu as forward_op
    from tokamax._src.ops.attention import pallas_mosaic_gpu_vjp as backward_op
    from tokamax._src.ops.attention import pallas_mosaic_gpu_vjp_kernel_sm90 as sm90

    from angel_jax import kernels

    results = []
    for shape in shapes.split(","):
        t, h = map(int, shape.split(":"))
        for causal in (True, False):
            b = max(1, 16384 // t)
            keys = jax.random.split(jax.random.key(0), 4)
            q, do = (jax.random.normal(key, (b, t, heads, h), jnp.bfloat16) for key in keys[:2])
            k, v = (jax.random.normal(key, (b, t, kv_heads, h), jnp.bfloat16) for key in keys[2:])
            flops = 3.5 * 4 * b * t * t * heads * h / (2 if causal else 1)

            def cudnn(q, k, v, do, causal=causal):
                attend = lambda q, k, v: jax.nn.dot_product_attention(
                    q, k, v, is_causal=causal, implementation="cudnn"
                )
                return jax.vjp(attend, q, k, v)[1](do)

            def block(q, k, v, do, ops, causal=causal):
                q, do = grouped(q, kv_heads), grouped(do, kv_heads)
                out, lse = kernels.tokamax_block(q, k, v, causal, ops)
                return kernels.tokamax_block_grads(q, k, v, do, out, lse, causal, ops)

            row = dict(batch=b, seq_len=t, head_dim=h, causal=causal)
            row["cudnn_fwd_bwd_tflops"] = flops / timed(jax.jit(cudnn), q, k, v, do) / 1e12
            for bq, bkv, stages, wgs in VJP_CONFIGS:
                config = sm90.Config(
                    block_q_dkv=bq, block_kv_dkv=bkv, block_q_dq=bq, block_kv_dq=bkv,
                    num_stages=stages, compute_wgs=wgs,
                )  # fmt: skip
                ops = (forward_op.PallasMosaicGpuFlashAttention(),
                       backward_op.PallasMosaicGpuFlashAttentionVjp(config=config))  # fmt: skip
                key = f"bwd_{bq}x{bkv}_stages{stages}_wgs{wgs}_tflops"
                run = jax.jit(functools.partial(block, ops=ops))  # This config's kernels.
                try:
                    row[key] = flops / timed(run, q, k, v, do) / 1e12
                except Exception as e:  # noqa: BLE001 - a config that does not fit is a result.
                    row[key] = f"{type(e).__name__}: {str(e)[:160]}"
            results.append(row)
            print(json.dumps(row), flush=True)
    return results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shapes", default="2048:64,8192:64,32768:64,8192:128")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--out", default=str(ROOT / "runs/experiments/attention_kernels.json"))
    p.add_argument("--blocks", default="cudnn,tokamax", help="ring block kernels to time")
    p.add_argument("--vjp-configs", action="store_true", help="sweep tokamax's backward configs")
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    import jax
    import jax.numpy as jnp

    if args.vjp_configs:
        write_results(args.out, sweep_vjp_configs(args.shapes, args.heads, args.kv_heads))
        return 0

    from angel_jax.kernels import choose

    ring_blocks, _ = choose("ring_blocks", "auto", "bfloat16")  # What the ring runs by default.
    results = []
    for shape in args.shapes.split(","):
        t, h = map(int, shape.split(":"))
        b, n, kv = max(1, 16384 // t), args.heads, args.kv_heads
        keys = jax.random.split(jax.random.key(0), 4)
        q, do = (jax.random.normal(key, (b, t, n, h), jnp.bfloat16) for key in keys[:2])
        k, v = (jax.random.normal(key, (b, t, kv, h), jnp.bfloat16) for key in keys[2:])
        flops = 4 * b * t * t * n * h / 2
        row = dict(batch=b, seq_len=t, heads=n, kv_heads=kv, head_dim=h)
        cudnn = jax.jit(
            lambda q, k, v: jax.nn.dot_product_attention(
                q, k, v, is_causal=True, implementation="cudnn"
            )
        )
        runs = [
            ("cudnn", cudnn, (q, k, v), flops),
            ("cudnn_fwd_bwd", jax.jit(cudnn_forward_backward), (q, k, v, do), 3.5 * flops),
        ]
        ring_runs = (
            ("block", ring_block_forward, (q, k, v), flops),
            ("block_fwd_bwd", ring_block_forward_backward, (q, k, v, do), 3.5 * flops),
            ("diagonal_fwd_bwd", ring_diagonal_forward_backward, (q, k, v, do), 3.5 * flops),
        )
        for blocks in args.blocks.split(","):
            for name, fn, args_, work in ring_runs:
                fn = jax.jit(functools.partial(fn, blocks=blocks))
                runs.append((f"{blocks}_{name}", fn, args_, work))
        for name, fn, args_, work in runs:
            try:
                row[f"{name}_kernels"] = custom_calls(fn.lower(*args_).compile().as_text())
                row[f"{name}_tflops"] = work / timed(fn, *args_) / 1e12
            except Exception as e:  # noqa: BLE001 - a kernel that fails to compile is a result.
                row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        results.append(row)
        print(json.dumps(row), flush=True)
    names = ["cudnn", "cudnn_fwd_bwd"]
    names += [
        f"{b}_{n}"
        for b in args.blocks.split(",")
        for n in ("block", "block_fwd_bwd", "diagonal_fwd_bwd")
    ]
    print(f"\nTFLOP/s\n{'seq_len':>8} {'hdim':>5} {'batch':>6}", *(f"{n:>24}" for n in names))
    for r in results:
        cells = [f"{r[f'{n}_tflops']:.1f}" if f"{n}_tflops" in r else "failed" for n in names]
        for b in args.blocks.split(","):  # The ring block's forward + backward against cuDNN's.
            r[f"{b}_block_fwd_bwd_over_cudnn"] = r.get(f"{b}_block_fwd_bwd_tflops", 0) / r.get(
                "cudnn_fwd_bwd_tflops", 1
            )
        if f"{ring_blocks}_block_fwd_bwd_tflops" in r:
            r["ring_blocks_auto"] = ring_blocks
            r["ring_block_fwd_bwd_tflops"] = r[f"{ring_blocks}_block_fwd_bwd_tflops"]
        print(f"{r['seq_len']:>8} {r['head_dim']:>5} {r['batch']:>6}", *(f"{c:>24}" for c in cells))
    write_results(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
