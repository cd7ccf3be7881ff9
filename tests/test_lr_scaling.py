"""The learning rate from the batch size (angel_jax/optim/scaling.py, arXiv 2405.14578)."""

import math

import numpy as np
import pytest

from angel_jax.config import ConfigError, default_config, validate
from angel_jax.optim import learning_rate_schedule
from angel_jax.optim.scaling import lr_and_warmup, scaled_lr, scaled_warmup, surge_factor


def test_surge_rule_rises_peaks_at_the_noise_batch_and_falls():
    noise = 512
    batches = 2.0 ** np.arange(0, 19)
    factors = np.array([surge_factor(b, noise) for b in batches])
    assert batches[np.argmax(factors)] == noise and surge_factor(noise, noise) == 1.0
    peak = int(np.argmax(factors))
    assert np.all(np.diff(factors[: peak + 1]) > 0) and np.all(np.diff(factors[peak:]) < 0)
    # Symmetric in log(batch) around the peak.
    for k in (2, 8, 64):
        assert surge_factor(noise * k, noise) == pytest.approx(surge_factor(noise / k, noise))
    # Far below the peak it is the square-root rule: 2 sqrt(B / B_noise).
    assert surge_factor(1, 10**6) == pytest.approx(2 * math.sqrt(1e-6), rel=1e-5)
    # The closed form: lr_max / (0.5 (sqrt(Bn / B) + sqrt(B / Bn))) at B = Bn / 4: 1 / 1.25.
    assert surge_factor(128, 512) == pytest.approx(0.8)


@pytest.mark.parametrize(
    "rule, expected",
    [
        ("none", 1e-3),
        ("linear", 4e-3),
        ("sqrt", 2e-3),
        # Tuned at 64 with the peak at 1024: factors 0.4706 -> 0.8 at 256.
        ("surge", 1e-3 * 0.8 / (2 / (4 + 0.25))),
    ],
)
def test_rules_move_a_tuned_rate_from_its_batch(rule, expected):
    assert scaled_lr(1e-3, 256, 64, rule, noise_batch=1024) == pytest.approx(expected)
    assert scaled_lr(1e-3, 64, 64, rule, noise_batch=1024) == 1e-3  # Same batch: unchanged.


def test_surge_past_the_peak_lowers_the_rate():
    assert scaled_lr(1e-3, 4096, 1024, "surge", noise_batch=1024) < 1e-3
    assert scaled_lr(1e-3, 4096, 1024, "sqrt") > 1e-3


def test_warmup_keeps_its_samples():
    assert scaled_warmup(100, batch=256, base_batch=64) == 25
    assert scaled_warmup(100, batch=16, base_batch=64) == 400
    assert scaled_warmup(1, batch=1024, base_batch=64) == 1  # Never below one step,
    assert scaled_warmup(0, batch=1024, base_batch=64) == 0  # unless there was none.


def test_config_drives_the_schedule():
    config = default_config()
    config.train.update(
        lr=1e-3,
        warmup_steps=40,
        steps=1000,
        batch_size=256,
        lr_scaling="surge",
        lr_base_batch=64,
        lr_noise_batch=1024,
    )
    validate(config)
    lr, warmup = lr_and_warmup(config.train)
    assert warmup == 10 and lr == pytest.approx(scaled_lr(1e-3, 256, 64, "surge", 1024))
    schedule = learning_rate_schedule(config.train)
    assert float(schedule(5)) == pytest.approx(lr / 2)  # Half-way through the warmup,
    assert float(schedule(10)) == pytest.approx(lr)  # at the peak after it.
    config.train.lr_scaling = "none"
    assert float(learning_rate_schedule(config.train)(40)) == pytest.approx(1e-3)


def test_surge_needs_the_noise_batch():
    config = default_config()
    config.train.lr_scaling = "surge"
    with pytest.raises(ConfigError, match="config.train.lr_noise_batch"):
        validate(config)
    config.train.lr_scaling = "cubic"
    with pytest.raises(ConfigError, match="use one of none, linear, sqrt, surge"):
        validate(config)
