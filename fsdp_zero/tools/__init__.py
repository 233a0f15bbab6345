"""Offline: the planner, the fit, compare, the rates probe and the plan's printouts; never imported
by training."""

from fsdp_zero.tools.candidates import DEFAULT_SEARCH, FitSearch, Scored, searched_overrides
from fsdp_zero.tools.candidates import DIMENSIONS as FIT_DIMENSIONS
from fsdp_zero.tools.compare import (
    COMPARE_DEFAULTS,
    COMPARE_ORDER,
    compare_report,
    dataparallel_row,
    read_rows,
)
from fsdp_zero.tools.fit import FIT_MARGIN, fit_rates, fit_search, offload_rates
from fsdp_zero.tools.formulas import (
    PAPER_K,
    PLAN_MODES,
    TierBytes,
    Trained,
    deepspeed_zero3_estimate,
    format_bytes,
    format_gb,
    plan_communication,
    rank_tiers,
    strategy_states,
    tier_rows,
    zero_paper_stages,
)
from fsdp_zero.tools.launch import bench_main, run_logged, script_parser, train_command
from fsdp_zero.tools.layout import StageRow, Workload, layout_rows
from fsdp_zero.tools.planner import Simulator, nf4_saving, simulate
from fsdp_zero.tools.prediction import HEAP_RETENTION, Prediction
from fsdp_zero.tools.rates import Rates, add_rate_flags, given_rates
from fsdp_zero.tools.render import (
    PlanFacts,
    communication_table,
    fit_heading,
    fit_rates_line,
    fit_table,
    formulas_table,
    layout_table,
    memory_table,
    tiers_table,
)

__all__ = [
    "add_rate_flags",
    "bench_main",
    "communication_table",
    "COMPARE_DEFAULTS",
    "COMPARE_ORDER",
    "compare_report",
    "dataparallel_row",
    "deepspeed_zero3_estimate",
    "DEFAULT_SEARCH",
    "FIT_DIMENSIONS",
    "fit_heading",
    "FitSearch",
    "FIT_MARGIN",
    "fit_rates",
    "fit_rates_line",
    "fit_search",
    "fit_table",
    "format_bytes",
    "format_gb",
    "given_rates",
    "formulas_table",
    "HEAP_RETENTION",
    "layout_rows",
    "layout_table",
    "memory_table",
    "nf4_saving",
    "offload_rates",
    "PAPER_K",
    "plan_communication",
    "PlanFacts",
    "PLAN_MODES",
    "Prediction",
    "Rates",
    "rank_tiers",
    "read_rows",
    "run_logged",
    "Scored",
    "StageRow",
    "searched_overrides",
    "simulate",
    "Simulator",
    "strategy_states",
    "script_parser",
    "train_command",
    "TierBytes",
    "tier_rows",
    "tiers_table",
    "Trained",
    "Workload",
    "zero_paper_stages",
]
