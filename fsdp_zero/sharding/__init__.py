"""A strategy applied: wrap units, precision, parallelize, build and the optimizer."""
