"""Llama-3-405B shape (126 layers, d 16384, ffn 53248, 128 heads, 8 KV heads, vocab 128256).

    python -m angel_jax.plan --config configs/llama3_405b.py --gpus 1024 --gpu h100

Derived from configs/llama3_70b.py. A mesh of hundreds of GPUs: plan it first
(docs/planning.md) and pass the planner's layout as overrides to `angel_jax.launch`. The batch
is Llama 3's at 8k tokens per sequence on 8,192 GPUs (16M tokens, arXiv 2407.21783 Table 4).
"""

import pathlib

from angel_jax.config import load_config


def get_config():
    c = load_config(str(pathlib.Path(__file__).with_name("llama3_70b.py")))
    c.model.update(num_layers=126, d_model=16384, num_heads=128, ffn_dim=53248)
    c.train.update(batch_size=2048, microbatches=16, lr=8e-5)
    return c
