"""Hugging Face interop: import local safetensors checkpoints into our parameter trees, sharded
as they load, and export them back.

hf.py reads and writes the checkpoint directory format; one module per architecture maps its
tensors to our params. Each such module has:
  model_settings(hf_config: dict, setting: str) -> dict   our config.model settings
  load_params(path, abstract_params, shardings, setting)   our params, sharded as they load
  save_params(path, params, model_config, dtype, max_shard_bytes)   our params written as one
and is named by its family (angel_jax/family.py `Family.converter`, with the Hugging Face
`model_type`s it reads); `angel_jax.models.converter` finds it for a checkpoint.
"""
