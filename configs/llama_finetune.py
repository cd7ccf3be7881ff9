"""Fine-tune a Hugging Face Llama or Mixtral checkpoint (a local directory with config.json and
safetensors weights, e.g. one written by transformers' save_pretrained):

    python -m angel_jax.launch --config configs/llama_finetune.py --workdir /tmp/angel-ft \\
        --config.init_from_hf=/path/to/hf_checkpoint --config.data.path=/path/to/tokens

The checkpoint's config.json sets the architecture (config.model), and its weights are loaded
straight into their shards in place of a random init; a checkpoint of this run in --workdir
still wins, so a restarted run resumes. The data must be tokenized with the checkpoint's own
tokenizer. Check the result by eye with

    python -m angel_jax.generate --config configs/llama_finetune.py --checkpoint /tmp/angel-ft \\
        --config.init_from_hf=/path/to/hf_checkpoint --prompt-tokens 1,450,4996 --steps 32

and hand it back to Hugging Face with

    python -m angel_jax.export --config configs/llama_finetune.py --checkpoint /tmp/angel-ft \
        --config.init_from_hf=/path/to/hf_checkpoint --out /tmp/angel-ft-hf

On a CPU, a small checkpoint works with --config.model.dtype=float32 --config.train.seq_len=64.
"""

from angel_jax.config import default_config


def get_config():
    c = default_config()
    c.zero_stage = 3  # Pretrained models are large: params, grads and moments all sharded.
    c.model.remat = "dots_no_batch"
    # Fine-tuning: a small learning rate, short warmup, little decay of what was learnt.
    c.train.update(
        steps=1000,
        batch_size=8,
        seq_len=2048,
        lr=2e-5,
        warmup_steps=50,
        min_lr_ratio=0.1,
        weight_decay=0.0,
        grad_clip=1.0,
        log_every_steps=10,
    )
    c.checkpoint.every_steps = 200
    return c
