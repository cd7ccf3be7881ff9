"""A CPU-sized Mixtral-style model: 8 experts, top-2 routing with capacity, in every layer.

    python -m angel_jax.launch --config configs/mixtral_tiny.py --workdir /tmp/angel-moe

On 8 emulated CPU devices, split the experts over 4 of them (expert parallel; the batch is split
over data x expert): --config.mesh.expert=4 --config.mesh.data=2.
"""

from angel_jax.config import default_config


def get_config():
    c = default_config()
    c.model.update(
        num_layers=2,
        d_model=128,
        num_heads=4,
        num_kv_heads=2,
        ffn_dim=384,
        vocab_size=512,
        num_experts=8,
        experts_per_token=2,
        moe_ffn_dim=192,
        router="topk",
        capacity_factor=1.25,
    )
    c.train.update(
        steps=200, batch_size=16, seq_len=128, lr=3e-3, warmup_steps=20, log_every_steps=20
    )
    c.checkpoint.every_steps = 100
    return c
