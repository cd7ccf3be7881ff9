"""shard_map regions with explicit collectives: ring and Ulysses attention, expert parallel,
the pipeline, FP8 collectives."""
