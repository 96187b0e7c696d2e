"""Benchmarks: scripts that print numbers and write JSON under bench/results/."""
