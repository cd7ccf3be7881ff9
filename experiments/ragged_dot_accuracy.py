"""Grouped GEMM gradients against float32: tokamax's Mosaic GPU kernel and `lax.ragged_dot`,
random group sizes and sizes aligned to 128 and 64 rows, at a small shape and at `moe_1b`'s
expert shape (98,304 x 2048 -> 1408, 16 groups). Prints each one's relative error of dX and dW
and tokamax's forward + backward TFLOP/s (a log of its own).

    python experiments/ragged_dot_accuracy.py      # on a GPU with tokamax
"""

import jax
import jax.numpy as jnp
import numpy as np
import tokamax
from throughput import timed


def relative(a, b) -> float:
    a, b = np.float32(a), np.float32(b)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def aligned(sizes: np.ndarray, m: int, align: int) -> np.ndarray:
    """`sizes` rounded down to multiples of `align`, the remainder on the first group."""
    s = (sizes // align) * align
    s[-1] += m - s.sum()
    s[-1] -= s[-1] % align
    s[0] += m - s.sum()
    return s


def grads(impl: str, x, w, dy, sizes):
    """(dX, dW) of the grouped matmul for output cotangent dy: tokamax's kernel, XLA's, or
    float32 XLA at full precision (the reference)."""
    if impl == "mosaic":
        f = lambda x, w: tokamax.ragged_dot(x, w, sizes, implementation="mosaic")
    else:
        f = lambda x, w: jax.lax.ragged_dot(x, w, sizes)
    if impl == "f32":
        x, w, dy = (a.astype(jnp.float32) for a in (x, w, dy))
        with jax.default_matmul_precision("highest"):
            return jax.vjp(f, x, w)[1](dy)
    return jax.jit(lambda x, w: jax.vjp(f, x, w)[1](dy))(x, w)


def tokamax_tflops(x, w, sizes) -> float:
    loss = lambda x, w: jnp.sum(
        tokamax.ragged_dot(x, w, sizes, implementation="mosaic").astype(jnp.float32) ** 2
    )
    m, k, n = x.shape[0], x.shape[1], w.shape[2]
    return 6 * m * k * n / timed(jax.jit(jax.grad(loss, (0, 1))), x, w) / 1e12


def main() -> None:
    for m, k, n, g in [(4096, 256, 512, 8), (98304, 2048, 1408, 16)]:
        keys = jax.random.split(jax.random.key(0), 3)
        x = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
        dy = jax.random.normal(keys[1], (m, n), jnp.bfloat16)
        w = jax.random.normal(keys[2], (g, k, n), jnp.bfloat16)
        base = np.random.default_rng(0).multinomial(m, [1 / g] * g)
        for name, sizes in [
            ("random", base),
            ("mult128", aligned(base, m, 128)),
            ("mult64", aligned(base, m, 64)),
        ]:
            sizes = jnp.asarray(sizes, jnp.int32)
            exact = grads("f32", x, w, dy, sizes)
            for impl in ("mosaic", "lax"):
                got = grads(impl, x, w, dy, sizes)
                dx, dw = (relative(a, b) for a, b in zip(got, exact, strict=True))
                per_group = [relative(got[1][i], exact[1][i]) for i in range(g)]
                worst = f"worst group {int(np.argmax(per_group))}: {max(per_group):.4f}"
                head = [int(s) for s in sizes][:4]
                print(m, name, impl, f"dx {dx:.4f} dw {dw:.4f}", worst, "sizes", head, flush=True)
            print(f"   tokamax fwd+bwd {tokamax_tflops(x, w, sizes):.1f} TFLOP/s", flush=True)


if __name__ == "__main__":
    main()
