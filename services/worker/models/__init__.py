"""Model implementations that run over the paged KV cache, and the checkpoint loader."""
