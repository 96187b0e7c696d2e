"""The worker service: owns a model replica, its paged KV cache, and runs forward steps."""
