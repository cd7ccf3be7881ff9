"""ZeRO-Cache's executors, carrying out what `angel_jax.planning` placed: the offloaded
state's layout (`state`), the streamed update (`stream`), the host cores' share of it
(`cpu`), the SSD tier (`ssd`) and the split float32 masters (`masters`)."""
