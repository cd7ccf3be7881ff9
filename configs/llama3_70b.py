"""Llama-3-70B shape (80 layers, d 8192, ffn 28672, 64 heads, 8 KV heads, vocab 128256).

    python -m angel_jax.plan --config configs/llama3_70b.py --gpus 64 --gpu h100
    python -m angel_jax.launch --config configs/llama3_70b.py --workdir /tmp/angel-70b

Far too large for one GPU: plan the mesh first (docs/planning.md). The defaults are the
planner's pick for 64 H100s (8 hosts) at 8k tokens and a batch of 128 sequences (NeMo's
batch on the same machine): tensor 4 within a host, ZeRO-3 over the 16 data replicas,
dots_attention remat, 8 microbatches (66.5 GiB a GPU predicted, 66.7 in the program compiled
for 8 x 8 H100s). On another machine, run the planner and pass its layout as overrides.
"""

from angel_jax.config import default_config


def get_config():
    c = default_config()
    c.zero_stage = 3
    c.mesh.tensor = 4
    c.model.update(
        num_layers=80,
        d_model=8192,
        num_heads=64,
        num_kv_heads=8,
        ffn_dim=28672,
        vocab_size=128256,
        rope_theta=500000.0,
        remat="dots_attention",
    )
    c.train.update(
        steps=1000, batch_size=128, seq_len=8192, microbatches=8, lr=1.5e-4, warmup_steps=100
    )
    c.data.synthetic = True
    c.checkpoint.every_steps = 500
    return c
