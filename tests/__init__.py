"""Tandem test suite (run with `make test`)."""
