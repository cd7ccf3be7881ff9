"""Planning: what a run holds where, decided before anything is allocated, from a `PlanInput`
(`inputs.py`) made once from the config and the mesh. The ZeRO-Cache placement of each model
state on the device, in pinned host memory or on SSD (`placement.py`, its update's chunks in
`chunks.py`, its tiers' budgets in `tiers.py`, the update's groups in `groups.py`), the
activations each remat policy keeps and the remat choice (`activations.py`), the pipeline's
stage plan (`stage_plan.py`), the memory model they share (`memory.py`), the check of a
compiled step against the plan (`compiled.py`) and the loop that plans, builds, compiles,
checks and plans again (`settle.py`). It imports no executor (`angel_jax.offload`), step or
trainer: those carry out what it decides.
"""
