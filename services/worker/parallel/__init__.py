"""Tensor and pipeline parallelism inside a worker (issue 15)."""
