"""ZeRO-Cache: the memory tiers and their budgets (`tiers`), the planner (`planner`), the
streamed update's groups (`groups`), the offloaded state's layout (`state`), the streamed
update (`stream`), the host cores' share of it (`cpu`) and the SSD tier (`ssd`)."""
