"""ZeRO-Cache: the memory-tier planner, the offloaded state's layout, the streamed update and
the SSD tier."""
