"""Samples and scores to a loss: the training algorithms (methods) and the per-token losses."""
