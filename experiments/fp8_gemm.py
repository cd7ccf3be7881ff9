"""One projection's forward + backward (y = x.w, then dx and dw from a random output gradient)
in bf16 and on FP8 GEMMs, with current scaling and with a fixed scale of 1: the fixed scale
skips the absolute-maximum passes, so its gain bounds what delayed scaling (an amax history)
could save. Each row counts the compiled program's GEMM kernels.

    python experiments/fp8_gemm.py [--shape 16384,4096,14336] [--out FILE]
"""

import argparse
import json
import sys

from throughput import ROOT, custom_calls, timed, write_results


def fixed_scale(x, dtype, axis_name=None):
    """`fp8.quantize` with scale 1: saturating cast, no amax (not for training: no range)."""
    import jax.numpy as jnp

    fmax = float(jnp.finfo(dtype).max)
    return jnp.clip(x.astype(jnp.float32), -fmax, fmax).astype(dtype), jnp.float32(1.0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", default="16384,4096,14336", help="tokens, input width, output width")
    p.add_argument("--out", default=str(ROOT / "runs/experiments/fp8_gemm.json"))
    a = p.parse_args()
    sys.path.insert(0, str(ROOT))
    import jax
    import jax.numpy as jnp

    from angel_jax import fp8

    m, k, n = map(int, a.shape.split(","))
    kx, kw, kg = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (m, k), jnp.bfloat16)
    w = jax.random.normal(kw, (k, n), jnp.bfloat16) * 0.02
    g = jax.random.normal(kg, (m, n), jnp.bfloat16)
    variants = [
        ("bf16", lambda x, w: x @ w),
        ("fp8 current scaling", fp8.matmul),
        (
            "fp8 fixed scale (bound of delayed scaling)",
            lambda x, w: fp8.matmul(x, w, 1, fixed_scale),
        ),
    ]
    results = []
    for name, matmul in variants:

        @jax.jit
        def step(x, w, g, matmul=matmul):
            y, vjp = jax.vjp(matmul, x, w)
            return y, *vjp(g)

        seconds = timed(step, x, w, g, reps=20)
        kernels = custom_calls(step.lower(x, w, g).compile().as_text())
        results.append(
            dict(
                system=name,
                ms=seconds * 1e3,
                tflops=6 * m * k * n / seconds / 1e12,
                shape=[m, k, n],
                kernels=kernels,
            )
        )
        print(json.dumps(results[-1]), flush=True)
    base = results[0]["ms"]
    print(f"\n{'variant':<45} {'ms':>7} {'TFLOP/s':>8} {'vs bf16':>8}  kernels")
    for r in results:
        print(
            f"{r['system']:<45} {r['ms']:>7.2f} {r['tflops']:>8.0f} {base / r['ms']:>8.3f}  "
            f"{r['kernels']}"
        )
    write_results(a.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
