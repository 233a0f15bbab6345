"""Offline: the planner, the fit, compare and the rates probe; never imported by training."""
