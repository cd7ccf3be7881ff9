"""Llama-3-8B shape (32 layers, d 4096, ffn 14336, 32 heads, 8 KV heads, vocab 128256).

    python -m angel_jax.launch --config configs/llama3_8b.py --workdir /tmp/angel-8b

Sized for two or more H200s with ZeRO-3 (fp32 master params + Adam state are 12 bytes per
parameter, 96 GB for 8B, before grads); one H200 trains it with those states in host memory:
--config.offload.policy=optimizer --config.zero_stage=1 --config.train.microbatches=8.
"""

from angel_jax.config import default_config


def get_config():
    c = default_config()
    c.zero_stage = 3
    c.model.update(
        num_layers=32,
        d_model=4096,
        num_heads=32,
        num_kv_heads=8,
        ffn_dim=14336,
        vocab_size=128256,
        rope_theta=500000.0,
        remat="dots_no_batch",
    )
    c.train.update(steps=1000, batch_size=8, seq_len=8192, lr=3e-4, warmup_steps=100)
    c.data.synthetic = True
    c.checkpoint.every_steps = 500
    return c
