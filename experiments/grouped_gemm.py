"""Grouped GEMM TFLOP/s at `moe_1b`'s expert shape: tokamax's Mosaic GPU kernel (as
angel_jax/kernels.py calls it, heuristic config) against `lax.ragged_dot` and a dense matmul of
the same FLOPs, forward and forward + backward, then tokamax autotuned for the shape.

    python experiments/grouped_gemm.py [--rows 98304] [--out FILE]

Rows are the assignments (16384 tokens x 6 experts each), sorted by expert; group sizes come
from top-6 routing of random logits over 16 experts. FLOPs: 2 M K N forward, 3 times that
forward + backward (dX and dW).
"""

import argparse
import sys
import time

from throughput import ROOT, custom_calls, timed, write_results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", type=int, default=98304)
    p.add_argument("--d-model", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=1408)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--autotune", action="store_true", help="also time tokamax autotuned")
    p.add_argument("--out", default=str(ROOT / "experiments/results/grouped_gemm.json"))
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

    def fwd_bwd(fn):
        return jax.jit(jax.grad(lambda x, w: jnp.sum(fn(x, w).astype(jnp.float32) ** 2), (0, 1)))

    ops = {
        "dense": lambda x, w: x @ w[0],
        "lax": lambda x, w: ragged_dot(x, w, sizes, "xla"),
        "tokamax": lambda x, w: ragged_dot(x, w, sizes, "tokamax"),
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
