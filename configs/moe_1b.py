"""A DeepSeek-style mixture of experts for one or two H200s: fine-grained experts (16 of 1408,
6 routed per token) plus 2 shared ones, at the TinyLlama-1.1B trunk (22 layers, d 2048).

    python -m angel_jax.launch --config configs/moe_1b.py --workdir /tmp/angel-moe-1b

About 1.4B active and 3.8B total parameters (their AdamW states fit one H200). Two GPUs:
--config.mesh.expert=2 --config.mesh.data=1.
"""

import pathlib

from angel_jax.config import load_config


def get_config():
    c = load_config(str(pathlib.Path(__file__).with_name("llama_1b.py")))  # The dense twin.
    c.model.update(
        num_experts=16,
        experts_per_token=6,
        moe_ffn_dim=1408,
        shared_experts=2,
        router="topk",
        capacity_factor=1.25,
        remat="dots_no_batch",  # The fastest that fit, as measured (moe_throughput.py).
        # Unrolled: a scan stacks each layer's saved values (zero-filled, then copied in), about
        # 6% of a step (experiments/profile_step.py).
        scan_layers=False,
    )
    return c
