"""Multi-LoRA serving on the worker: PEFT adapters, their slots, the batched updates."""
