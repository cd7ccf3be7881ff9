"""T5-base shape (220M: 12 + 12 layers, d 768, 12 heads, ffn 3072 ReLU, vocab 32128, tied
embeddings, 32 relative position buckets up to distance 128), span corruption.

    python -m angel_jax.launch --config configs/t5_base.py --workdir /tmp/angel-t5-base

Synthetic tokens by default; set --config.data.path=TOKENS.npy for real data (the sentinels
are the top ids of config.model.vocab_size: the data's ids must lie below them).
"""

from angel_jax.config import default_config


def get_config():
    c = default_config()
    c.model.update(
        family="t5",
        num_layers=12,
        decoder_layers=12,
        d_model=768,
        num_heads=12,
        num_kv_heads=12,
        ffn_dim=3072,
        vocab_size=32128,
        norm_eps=1e-6,
        tie_embeddings=True,
        remat="dots_no_batch",
    )
    c.train.update(steps=1000, batch_size=64, seq_len=512, lr=1e-3, warmup_steps=100)
    c.data.synthetic = True
    c.checkpoint.every_steps = 500
    return c
