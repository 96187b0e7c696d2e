"""Model implementations that run over the paged KV cache, and the weight loader."""
