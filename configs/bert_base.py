"""BERT-base shape (110M: 12 layers, d 768, 12 heads, ffn 3072, 512 positions, vocab 30522
padded to 30528 so tensor parallel can split it), masked-LM objective.

    python -m angel_jax.launch --config configs/bert_base.py --workdir /tmp/angel-bert-base

Synthetic tokens by default; set --config.data.path=TOKENS.npy for real data (the top id of
config.model.vocab_size is the mask token: the data's ids must lie below it).
"""

from angel_jax.config import default_config


def get_config():
    c = default_config()
    c.model.update(
        family="bert",
        num_layers=12,
        d_model=768,
        num_heads=12,
        num_kv_heads=12,
        ffn_dim=3072,
        vocab_size=30528,
        max_positions=512,
        norm_eps=1e-12,
        tie_embeddings=True,
        remat="dots_no_batch",
    )
    c.train.update(
        steps=1000, batch_size=64, seq_len=512, lr=1e-4, warmup_steps=100, weight_decay=0.01
    )
    c.data.synthetic = True
    c.data.packing = True
    c.checkpoint.every_steps = 500
    return c
