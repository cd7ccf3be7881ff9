"""TinyLlama-1.1B shape (22 layers, d 2048, ffn 5632, 32 heads, 4 KV heads, vocab 32000).

    python -m angel_jax.launch --config configs/llama_1b.py --workdir /tmp/angel-1b

Defaults are for one H200 with synthetic tokens; set --config.data.path=TOKENS.npy for real
data (a token file from `python -m angel_jax.data.prepare`).
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
        # Saving the weight matmuls' outputs beat no remat, 10% faster at under half the peak
        # memory; also saving cuDNN attention's forward spares the backward pass its rerun
        # (about 4% of a step, experiments/profile_step.py).
        remat="dots_attention",
    )
    c.train.update(steps=1000, batch_size=8, seq_len=2048, lr=3e-4, warmup_steps=100)
    c.data.synthetic = True
    c.checkpoint.every_steps = 500
    return c
