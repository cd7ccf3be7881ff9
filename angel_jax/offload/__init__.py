"""ZeRO-Cache: memory-tier planner and streaming (a later issue)."""
