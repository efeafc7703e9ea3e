"""Benchmarks: each script measures the runtime against its baselines in one run, prints a table, writes JSON."""
