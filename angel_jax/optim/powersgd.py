"""PowerSGD (Vogels et al., 2019): data-parallel gradient averaging through rank-r factors, with
error feedback.

Each replica views its gradient of a layer's weight as a matrix M (the split of its dims that
is the most square), adds the error it carried from the last step, and the replicas agree on a
rank-r approximation of their mean: P = mean(M Q) over replicas, orthonormalised; then
Q' = mean(M^T P); the mean is taken as P Q'^T, and what it misses of each replica's M stays in
that replica's error for the next step. Q' warm-starts the next step's power iteration. On the
wire: r (rows + cols) numbers per matrix instead of rows x cols. The embedding, the LM head,
vectors and matrices too small to gain are averaged exactly.

Call `average` inside `shard_map` over `axis_name`; the errors are per replica (their global
arrays carry a leading replica axis, split over `axis_name`).
"""

import dataclasses
import math

import jax
import jax.numpy as jnp


def matrix_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """(rows, cols) of the split of `shape`'s dims into leading and trailing ones that is
    closest to square."""
    splits = [(math.prod(shape[:k]), math.prod(shape[k:])) for k in range(1, len(shape))]
    return min(splits, key=lambda rc: abs(math.log(rc[0] / rc[1])))


@dataclasses.dataclass(frozen=True)
class PowerSGD:
    rank: int
    axis_name: str = "data"

    def compresses(self, param, is_stacked: bool) -> bool:
        """The layers' matrices that rank-r factors make smaller. The embedding and LM head
        are averaged exactly: their grads (rows of the tokens seen) compress badly."""
        shape = param.shape[1:]
        if not is_stacked or len(shape) < 2:
            return False
        rows, cols = matrix_shape(shape)
        return self.rank * (rows + cols) < rows * cols

    def init(self, params, stacked, replicas: int, key):
        """Per parameter: (Q (cols, r) [per layer], this replica's error like the param [with
        a leading replica axis of `replicas`]), or None where it is averaged exactly."""
        leaves, treedef = jax.tree.flatten(params)
        keys = jax.random.split(key, len(leaves))

        def one(param, is_stacked, k):
            if not self.compresses(param, is_stacked):
                return None
            q_shape = (param.shape[0], matrix_shape(param.shape[1:])[1], self.rank)
            error = jnp.zeros((replicas, *param.shape), jnp.float32)
            return jax.random.normal(k, q_shape, jnp.float32), error

        return jax.tree.unflatten(
            treedef, list(map(one, leaves, treedef.flatten_up_to(stacked), keys))
        )

    def average(self, grads, state, stacked):
        """(mean of the replicas' grads, rank-r where compressed; new state). `state`'s errors
        are this replica's (leading axis of 1)."""

        def one(grad, s, is_stacked):
            if s is None:
                return jax.lax.pmean(grad, self.axis_name), None
            q, error = s
            mean, q, error = jax.vmap(self._compress)(grad.astype(jnp.float32) + error[0], q)
            return mean.astype(grad.dtype), (q, error[None])

        # `grads` is a prefix of the other trees: each call gets one parameter's whole state.
        out = jax.tree.map(one, grads, state, stacked)
        means = jax.tree.map(lambda _, o: o[0], grads, out)
        return means, jax.tree.map(lambda _, o: o[1], grads, out)

    def _compress(self, m, q):
        shape = m.shape
        m = m.reshape(matrix_shape(shape))
        p = jax.lax.pmean(m @ q, self.axis_name)
        p = jnp.linalg.qr(p)[0]
        q = jax.lax.pmean(m.T @ p, self.axis_name)
        approx = p @ q.T
        return approx.reshape(shape), q, (m - approx).reshape(shape)

    def wire_numbers(self, params, stacked) -> tuple[int, int]:
        """(numbers each replica all-reduces per step with PowerSGD, without it)."""
        sent = full = 0
        for param, is_stacked in zip(
            jax.tree.leaves(params), jax.tree.leaves(stacked), strict=True
        ):
            full += param.size
            if self.compresses(param, is_stacked):
                sent += param.shape[0] * self.rank * sum(matrix_shape(param.shape[1:]))
            else:
                sent += param.size
        return sent, full
