"""Llama-3-8B shape (32 layers, d 4096, ffn 14336, 32 heads, 8 KV heads, vocab 128256).

    python -m angel_jax.launch --config configs/llama3_8b.py --workdir /tmp/angel-8b

Sized for two or more GPUs with ZeRO-3 and 4 microbatches; the remat policy is the planner's
pick (the fastest that fits, checked against the compiled step): with dots_no_batch the
compiled step needs 133.7 GiB a GPU and is refused before allocation. One GPU trains it with
the fp32 masters and AdamW state in host memory: --config.offload.policy=auto
--config.zero_stage=1 (experiments/recipes.py's `offload_8b_1m` and `offload_8b_128k`, their
records in experiments/RESULTS.md).
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
        remat="auto",
    )
    c.train.update(
        steps=1000, batch_size=8, seq_len=8192, microbatches=4, lr=3e-4, warmup_steps=100
    )
    c.data.synthetic = True
    c.checkpoint.every_steps = 500
    return c
