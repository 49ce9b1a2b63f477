"""Benchmarks (`python -m dsv4ops bench`) and the demo (`python -m dsv4ops`)."""
