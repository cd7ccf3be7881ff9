"""shard_map regions with explicit collectives (ring attention, all-to-all, pipeline); none yet."""
