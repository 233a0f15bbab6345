"""Ranks, their environment and what they agree on."""
