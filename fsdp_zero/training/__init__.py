"""The run: step, stopping, evaluation, logging, run directory, trainer."""
