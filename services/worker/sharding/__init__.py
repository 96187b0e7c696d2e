"""How a tensor- or pipeline-parallel rank's model is cut: its slice of every layer
(`tp_group`, `weight_shards`, `mla_shards`) and its stage's layers (`pipeline_stage`). The
model code uses these; the rank processes that run the slices live in `parallel/` (above
the runner and the startup), a stage's micro-batches in `micro_batches.py`."""
