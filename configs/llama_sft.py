"""Supervised fine-tuning (SFT) of a Hugging Face chat model on conversations, learning the
assistant's turns only (docs/finetune.md):

    python -m angel_jax.data.prepare --jsonl chat.jsonl --tokenizer /path/to/hf_checkpoint \\
        --out /tmp/angel-sft/data.npy
    python -m angel_jax.launch --config configs/llama_sft.py --workdir /tmp/angel-sft/run \\
        --config.init_from_hf=/path/to/hf_checkpoint --config.data.path=/tmp/angel-sft/data.npy

`prepare --jsonl` renders each conversation with the checkpoint's chat template and marks the
assistant's tokens; the run packs conversations into rows with no attention across them and
takes the loss on the marked tokens alone. Without init_from_hf the model is config.model's, at
random: on a CPU, --config.model.dtype=float32 --config.train.seq_len=64 trains it in seconds.
"""

import pathlib

from angel_jax.config import load_config


def get_config():
    c = load_config(str(pathlib.Path(__file__).with_name("llama_finetune.py")))
    c.data.packing = True  # Conversations side by side in a row, each seeing only itself.
    c.data.loss_mask = True  # Loss on the assistant's tokens (the file's mask), not the prompt.
    return c
