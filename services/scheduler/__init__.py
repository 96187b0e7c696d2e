"""Scheduler: request lifecycle, block managers per worker pool, the step plans."""
