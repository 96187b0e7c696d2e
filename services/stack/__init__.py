"""Local deployment of the whole stack: `python -m services.stack up|down|status`."""
