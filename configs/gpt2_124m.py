"""GPT-2 small shape (124M: 12 layers, d 768, 12 heads, ffn 3072, 1024 positions, vocab 50257
padded to 50304 so tensor parallel can split it).

    python -m angel_jax.launch --config configs/gpt2_124m.py --workdir /tmp/angel-gpt2-124m

Synthetic tokens by default; set --config.data.path=TOKENS.npy (`python -m
angel_jax.data.prepare --tokenizer tokenizer.json`) for real data, packed by documents.
"""

from angel_jax.config import default_config


def get_config():
    c = default_config()
    c.model.update(
        family="gpt2",
        num_layers=12,
        d_model=768,
        num_heads=12,
        num_kv_heads=12,
        ffn_dim=3072,
        vocab_size=50304,
        max_positions=1024,
        tie_embeddings=True,
        remat="dots_no_batch",
    )
    c.train.update(steps=1000, batch_size=32, seq_len=1024, lr=6e-4, warmup_steps=100)
    c.data.synthetic = True
    c.data.packing = True
    c.checkpoint.every_steps = 500
    return c
