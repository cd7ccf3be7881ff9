"""Grouped GEMM TFLOP/s at `moe_1b`'s expert shape: JAX's Hopper Mosaic GPU kernels and
tokamax's (as angel_jax/kernels.py calls them) against `lax.ragged_dot` and a dense matmul of
the same FLOPs, forward and forward + backward, then tokamax autotuned for the shape.

    python experiments/grouped_gemm.py [--rows 98304] [--out FILE] [--autotune]
    python experiments/grouped_gemm.py --tiles [--out FILE]

--tiles sweeps the tiles of JAX's kernels instead, at both expert projections (2048 -> 1408
and 1408 -> 2048): the forward and dX (`ragged_dot_mgpu`, dX with the transposed weights) and
dW (`transposed_ragged_dot_mgpu`), each on its own; angel_jax/kernels.py takes the fastest.

Rows are the assignments (16384 tokens x 6 experts each), sorted by expert; group sizes come
from top-6 routing of random logits over 16 experts. FLOPs: 2 M K N forward, 3 times that
forward + backward (dX and dW).
"""

import argparse
import sys
import time

from throughput import ROOT, custom_calls, timed, write_results

# (block_m, block_n, max_concurrent_steps, grid_block_n) of the forward and dX; (block_m,
# block_n, block_k, max_concurrent_steps, grid_block_n) of dW. block_k 64 for the first: one
# 128-byte swizzle of bf16.
ROW_TILES = [(128, 128, 4, 1), (128, 128, 4, 8), (128, 256, 4, 8), (128, 128, 6, 8)]
ROW_TILES += [(64, 256, 4, 8), (192, 128, 4, 8), (128, 192, 4, 8), (256, 128, 3, 8)]
WEIGHT_TILES = [(128, 128, 64, 4, 1), (128, 128, 64, 4, 8), (64, 128, 64, 4, 8)]
WEIGHT_TILES += [(128, 64, 64, 4, 8), (128, 128, 128, 2, 8), (128, 128, 64, 6, 8)]


def sweep_tiles(x, w, sizes) -> list[dict]:
    """TFLOP/s of JAX's Hopper grouped GEMMs per tile, forward, dX and dW, at both projections
    (x's K -> w's N, and back), beside a dense matmul and tokamax's forward."""
    import jax
    import jax.numpy as jnp
    import tokamax
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu

    rows, results = x.shape[0], []
    for k, n in ((x.shape[1], w.shape[2]), (w.shape[2], x.shape[1])):
        keys = jax.random.split(jax.random.key(1), 3)
        x = jax.random.normal(keys[0], (rows, k), jnp.bfloat16)
        w = jax.random.normal(keys[1], (w.shape[0], k, n), jnp.bfloat16) / k**0.5
        dy = jax.random.normal(keys[2], (rows, n), jnp.bfloat16)
        flops = 2 * rows * k * n
        tflops = lambda fn, *args, flops=flops: flops / timed(jax.jit(fn), *args) / 1e12
        row = dict(k=k, n=n, dense=tflops(lambda x, w: x @ w[0], x, w))
        row["tokamax_fwd"] = tflops(
            lambda x, w: tokamax.ragged_dot(x, w, sizes, implementation="mosaic"), x, w
        )
        for bm, bn, steps, grid in ROW_TILES:
            tile = dict(block_m=bm, block_n=bn, block_k=64, max_concurrent_steps=steps)
            tile["grid_block_n"] = grid
            # dX = dy @ w[g]^T: w as stored is the transposed right-hand side.
            for mode, lhs, transpose in (("fwd", x, False), ("dx", dy, True)):
                fn = lambda lhs, w, tile=tile, t=transpose: ragged_dot_mgpu.ragged_dot(
                    lhs, w, group_sizes=sizes, transpose_rhs=t, **tile
                )
                key = f"{mode}_{bm}x{bn}_steps{steps}_grid{grid}"
                try:
                    row[key] = tflops(fn, lhs, w)
                except Exception as e:  # noqa: BLE001 - a tile that does not fit is a result.
                    row[key] = f"{type(e).__name__}: {str(e)[:150]}"
        for bm, bn, bk, steps, grid in WEIGHT_TILES:
            tile = dict(block_m=bm, block_n=bn, block_k=bk, max_concurrent_steps=steps)
            fn = lambda x, dy, tile=tile, g=grid: transposed_ragged_dot_mgpu.transposed_ragged_dot(
                x, dy, group_sizes=sizes, grid_block_n=g, **tile
            )
            key = f"dw_{bm}x{bn}_k{bk}_steps{steps}_grid{grid}"
            try:
                row[key] = tflops(fn, x, dy)
            except Exception as e:  # noqa: BLE001
                row[key] = f"{type(e).__name__}: {str(e)[:150]}"
        print({key: round(v, 1) if isinstance(v, float) else v for key, v in row.items()})
        results.append(row)
    return results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", type=int, default=98304)
    p.add_argument("--d-model", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=1408)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--autotune", action="store_true", help="also time tokamax autotuned")
    p.add_argument("--tiles", action="store_true", help="sweep JAX's kernels' tiles instead")
    p.add_argument("--out", default=str(ROOT / "runs/experiments/grouped_gemm.json"))
    a = p.parse_args()
    sys.path.insert(0, str(ROOT))
    import jax
    import jax.numpy as jnp

    from angel_jax.kernels import ragged_dot

    m, k, n, g = a.rows, a.d_model, a.hidden, a.experts
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
    w = jax.random.normal(keys[1], (g, k, n), jnp.bfloat16) / k**0.5
    top = jax.lax.top_k(jax.random.normal(keys[2], (m // 6, g)), 6)[1]
    sizes = jnp.bincount(top.reshape(-1), length=g).astype(jnp.int32)

    if a.tiles:
        write_results(a.out, sweep_tiles(x, w, sizes))
        return 0

    def fwd_bwd(fn):
        return jax.jit(jax.grad(lambda x, w: jnp.sum(fn(x, w).astype(jnp.float32) ** 2), (0, 1)))

    ops = {
        "dense": lambda x, w: x @ w[0],
        # Every row in a group (as in dropless MoE on one device): no masking around them.
        "lax": lambda x, w: ragged_dot(x, w, sizes, "xla", every_row=True),
        "tokamax": lambda x, w: ragged_dot(x, w, sizes, "tokamax", every_row=True),
        "jax_pallas": lambda x, w: ragged_dot(x, w, sizes, "jax_pallas", every_row=True),
    }
    flops = 2 * m * k * n
    row = dict(rows=m, d_model=k, hidden=n, experts=g, group_sizes=[int(s) for s in sizes])
    for name, op in ops.items():
        for mode, fn, work in (("fwd", jax.jit(op), flops), ("fwd_bwd", fwd_bwd(op), 3 * flops)):
            args = (x, w)
            row[f"{name}_{mode}_kernels"] = custom_calls(fn.lower(*args).compile().as_text())
            row[f"{name}_{mode}_tflops"] = work / timed(fn, *args) / 1e12
            print(name, mode, f"{row[f'{name}_{mode}_tflops']:.1f} TFLOP/s", flush=True)
    write_results(a.out, [row])  # Before the autotuning, which can run long.
    if a.autotune:
        import tokamax

        for mode, make in (("fwd", jax.jit), ("fwd_bwd", fwd_bwd)):
            fn = make(ops["tokamax"])
            start = time.perf_counter()
            tuned = tokamax.autotune(fn, x, w, progress_bar=False, timeout=60.0)
            row[f"autotune_{mode}_s"] = time.perf_counter() - start
            with tuned:
                fn = make(ops["tokamax"])
                row[f"tokamax_tuned_{mode}_tflops"] = (
                    (3 if mode == "fwd_bwd" else 1) * flops / timed(fn, x, w) / 1e12
                )
            print("tokamax tuned", mode, f"{row[f'tokamax_tuned_{mode}_tflops']:.1f}", flush=True)
    print({k: round(v, 1) for k, v in row.items() if k.endswith("tflops")})
    write_results(a.out, [row])
    return 0


if __name__ == "__main__":
    sys.exit(main())
