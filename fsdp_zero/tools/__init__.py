"""Offline: the planner, the fit, compare and the rates probe; never imported by training."""

from fsdp_zero.tools.candidates import DEFAULT_SEARCH, DIMENSIONS, Scored, searched_overrides
from fsdp_zero.tools.compare import DEFAULTS, ORDER, dataparallel_row, read_rows, report
from fsdp_zero.tools.fit import MARGIN, fit_rates, search
from fsdp_zero.tools.formulas import (
    PAPER_K,
    PLAN_MODES,
    Trained,
    deepspeed_zero3_estimate,
    format_bytes,
    format_gb,
    strategy_states,
    zero_paper_stages,
)
from fsdp_zero.tools.launch import bench_main, script_parser, train_command
from fsdp_zero.tools.layout import StageRow, layout_rows
from fsdp_zero.tools.planner import Simulator, nf4_saving, simulate
from fsdp_zero.tools.prediction import HEAP_RETENTION, Prediction
from fsdp_zero.tools.rates import Rates

__all__ = [
    "bench_main",
    "dataparallel_row",
    "deepspeed_zero3_estimate",
    "DEFAULTS",
    "DEFAULT_SEARCH",
    "DIMENSIONS",
    "fit_rates",
    "format_bytes",
    "format_gb",
    "HEAP_RETENTION",
    "layout_rows",
    "MARGIN",
    "nf4_saving",
    "ORDER",
    "PAPER_K",
    "PLAN_MODES",
    "Prediction",
    "Rates",
    "read_rows",
    "report",
    "Scored",
    "StageRow",
    "search",
    "searched_overrides",
    "simulate",
    "Simulator",
    "strategy_states",
    "script_parser",
    "train_command",
    "Trained",
    "zero_paper_stages",
]
