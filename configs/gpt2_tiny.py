"""A CPU-sized GPT-2 (learned positions, LayerNorm, GELU, tied embeddings) on the default corpus.

    python -m angel_jax.launch --config configs/gpt2_tiny.py --workdir /tmp/angel-gpt2

Documents are packed into rows with segment ids (config.data.packing): no attention across
them. On 8 emulated CPU devices add e.g. --config.mesh.data=4 --config.mesh.tensor=2.
"""

from angel_jax.config import default_config


def get_config():
    c = default_config()
    c.model.update(
        family="gpt2",
        num_layers=2,
        d_model=128,
        num_heads=4,
        num_kv_heads=4,
        ffn_dim=512,
        vocab_size=512,
        max_positions=256,
        tie_embeddings=True,
    )
    c.train.update(
        steps=200, batch_size=16, seq_len=128, lr=3e-3, warmup_steps=20, log_every_steps=20
    )
    c.data.packing = True
    c.checkpoint.every_steps = 100
    return c
