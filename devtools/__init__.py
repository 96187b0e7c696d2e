"""Developer tooling, not part of any service: builds the random-weight checkpoints that
tests, benchmarks and `make up` serve (Tandem never downloads a model)."""
