"""Samples, batches and token files."""
