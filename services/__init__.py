"""Tandem services: gateway, scheduler, workers and the stack that runs them."""
