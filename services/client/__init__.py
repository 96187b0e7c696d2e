"""A small CLI client of the public API."""
