"""What a step measures: memory, communication, metrics."""
