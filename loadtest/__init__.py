"""Workloads, load generators and benchmarks."""
