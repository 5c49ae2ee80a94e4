"""The `kvfleet` command: every CLI of the fleet under one name (kvfleet/cli.py)."""
