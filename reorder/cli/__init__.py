"""`python -m reorder`: the demo (real processes, synthetic data) and the offline simulator."""
