"""A small Llama on the default corpus (byte-level Python sources); trains in seconds on a CPU.

python -m angel_jax.launch --config configs/tiny.py --workdir /tmp/angel-tiny
"""

from angel_jax.config import default_config


def get_config():
    c = default_config()
    c.model.update(
        num_layers=2, d_model=128, num_heads=4, num_kv_heads=2, ffn_dim=384, vocab_size=512
    )
    c.train.update(
        steps=200, batch_size=16, seq_len=128, lr=3e-3, warmup_steps=20, log_every_steps=20
    )
    c.checkpoint.every_steps = 100
    return c
