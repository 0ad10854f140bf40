"""Datasets: rows in the common RL format, synthetic domains, converters from real sources."""
