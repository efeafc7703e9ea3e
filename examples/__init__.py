"""Example workloads that run on the Pathways-style runtime."""
