"""State on disk: DCP checkpoints and full weights."""
