"""A DeepSeek-style mixture of experts for one or two H200s: fine-grained experts (16 of 1408,
6 routed per token) plus 2 shared ones, at the TinyLlama-1.1B trunk (22 layers, d 2048).

    python -m angel_jax.launch --config configs/moe_1b.py --workdir /tmp/angel-moe-1b

About 1.4B active and 3.8B total parameters (their AdamW states fit one H200). Two GPUs:
--config.mesh.expert=2 --config.mesh.data=1.
"""

from angel_jax.config import default_config


def get_config():
    c = default_config()
    c.model.update(
        num_layers=22,
        d_model=2048,
        num_heads=32,
        num_kv_heads=4,
        ffn_dim=5632,
        vocab_size=32000,
        num_experts=16,
        experts_per_token=6,
        moe_ffn_dim=1408,
        shared_experts=2,
        router="topk",
        capacity_factor=1.25,
        remat="dots_no_batch",
    )
    c.train.update(steps=1000, batch_size=8, seq_len=2048, lr=3e-4, warmup_steps=100)
    c.data.synthetic = True
    c.checkpoint.every_steps = 500
    return c
