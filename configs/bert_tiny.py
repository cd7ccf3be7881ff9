"""A CPU-sized BERT trained with the masked-LM objective on the default corpus.

    python -m angel_jax.launch --config configs/bert_tiny.py --workdir /tmp/angel-bert

15% of the tokens are predicted (80% read [MASK], the top id of the vocabulary, 10% a random
token, 10% stay); documents are packed with segment ids (config.data.packing).
"""

from angel_jax.config import default_config


def get_config():
    c = default_config()
    c.model.update(
        family="bert",
        num_layers=2,
        d_model=128,
        num_heads=4,
        num_kv_heads=4,
        ffn_dim=512,
        vocab_size=512,
        max_positions=256,
        norm_eps=1e-12,
        tie_embeddings=True,
    )
    c.train.update(
        steps=200, batch_size=16, seq_len=128, lr=2e-3, warmup_steps=20, log_every_steps=20
    )
    c.data.packing = True
    c.checkpoint.every_steps = 100
    return c
