"""The learning rate for a batch size: move a tuned (lr, warmup) to another batch.

AngelPTM grows the batch as training goes and sets the learning rate from it. For SGD the
best rate grows linearly with the batch (or as its square root); for Adam-style optimizers
(sign-like updates) Li et al., "Surge Phenomenon in Optimal Learning Rate and Batch Size
Scaling" (arXiv 2405.14578), derive a rate that rises, peaks at the gradient-noise batch
B_noise, then falls:

    lr_opt(B) = lr_max / (0.5 * (sqrt(B_noise / B) + sqrt(B / B_noise)))

~ 2 lr_max sqrt(B / B_noise) well below B_noise (the square-root rule), lr_max at B = B_noise,
and falling as sqrt(B_noise / B) above it. B_noise grows as the loss falls, so measure it (a
small sweep of batch sizes, or the gradient noise scale) near the stage of training you scale
in.

Every rule takes `lr` as the rate tuned at `base_batch` and returns the rate at `batch`, so
lr_max never has to be known. Warmup keeps its number of samples: steps scale as
base_batch / batch.
"""

import math

import ml_collections


def surge_factor(batch: float, noise_batch: float) -> float:
    """lr_opt(batch) / lr_max of the surge rule: 1 at `noise_batch`, less on either side."""
    ratio = math.sqrt(noise_batch / batch)
    return 1.0 / (0.5 * (ratio + 1.0 / ratio))


def scaled_lr(lr: float, batch: int, base_batch: int, rule: str, noise_batch: int = 0) -> float:
    """The learning rate at `batch` for a rate `lr` tuned at `base_batch` (sequences)."""
    if rule == "none" or batch == base_batch:
        return lr
    if rule == "linear":
        return lr * batch / base_batch
    if rule == "sqrt":
        return lr * math.sqrt(batch / base_batch)
    if rule == "surge":
        return lr * surge_factor(batch, noise_batch) / surge_factor(base_batch, noise_batch)
    raise ValueError(f"unknown learning-rate scaling rule {rule!r}")


def scaled_warmup(warmup_steps: int, batch: int, base_batch: int) -> int:
    """Warmup steps at `batch` covering as many samples as `warmup_steps` at `base_batch`."""
    if warmup_steps == 0:
        return 0
    return max(1, round(warmup_steps * base_batch / batch))


def lr_and_warmup(train: ml_collections.ConfigDict) -> tuple[float, int]:
    """(peak learning rate, warmup steps) that `config.train` asks for at its batch size."""
    base = train.lr_base_batch or train.batch_size
    if train.lr_scaling == "none":
        return train.lr, train.warmup_steps
    return (
        scaled_lr(train.lr, train.batch_size, base, train.lr_scaling, train.lr_noise_batch),
        scaled_warmup(train.warmup_steps, train.batch_size, base),
    )
