"""Speculative decoding in the worker: proposers and the verification of their proposals
in the step's own forward pass (`verify`)."""
