"""A CPU-sized T5 encoder-decoder trained with span corruption on the default corpus.

    python -m angel_jax.launch --config configs/t5_tiny.py --workdir /tmp/angel-t5

15% of each window's tokens, in spans of 3 on average, become sentinels (the top ids of the
vocabulary) in the encoder's input; the decoder learns to write them out.
"""

from angel_jax.config import default_config


def get_config():
    c = default_config()
    c.model.update(
        family="t5",
        num_layers=2,
        decoder_layers=2,
        d_model=128,
        num_heads=4,
        num_kv_heads=4,
        ffn_dim=512,
        vocab_size=512,
        norm_eps=1e-6,
        tie_embeddings=True,
    )
    c.train.update(
        steps=200, batch_size=16, seq_len=128, lr=3e-3, warmup_steps=20, log_every_steps=20
    )
    c.checkpoint.every_steps = 100
    return c
