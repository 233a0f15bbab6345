"""Predict per-rank memory before a run, for each strategy: no training, no GPU.

    python scripts/plan.py simulate [--config configs/X.yaml] --world-size N [--strategy full_shard ...]
                                    [--device-memory 80GB] [--json out.json] [key=value ...]
    python scripts/plan.py formulas --params 7.5e9 --world-size 64     # formulas only, nothing built
    python scripts/plan.py layout [--config X.yaml] --world-size N parallel.tp_size=2 [key=value ...]
    python scripts/plan.py fit [--config X.yaml] --world-size N --device-memory 3GiB [--json F]
                               [--link-gbps G] [key=value ...]

simulate: simulates one rank of N with fake tensors and a fake process group
(fsdp_zero.tools.planner), then prints the peak by category, what a rank will show (on CPU: the
process's peak RSS, its measured baseline included; on CUDA: device memory), whether it fits
--device-memory, and for reference the ZeRO paper's model states per device (its Table 1) beside
each strategy's model state at rest and inside the step (fsdp_zero.tools.formulas'
`zero_paper_stages` and `strategy_states`), DeepSpeed's ZeRO-3 estimate, and the bytes each
strategy and precision mode communicates per step (fsdp_zero.monitor.comm) with their time at
--link-gbps.

formulas: the same model-state formulas for a parameter count alone (--params), nothing built, and
where AdamW's moments live under each offload.states tier (--step-group-size, --offload-ratio).

layout: with parallel.tp_size or parallel.pp_size > 1, their layout by formula (no simulation runs
them: fsdp_zero.tools.layout).

fit: searches strategy x precision x activation checkpointing x CPU offload x micro-batch x
parallel.grad_sync x offload.states and offload.ratio (fsdp_zero.tools.fit; the states' links
measured by a short probe), and with `--search ...,layout` every parallel.tp_size x
parallel.pp_size too (their peaks and costs by formula, fsdp_zero.tools.layout), and prints the
candidates ranked by a relative step cost, and the cheapest that fits --device-memory as key=value
overrides to paste onto the training command line.

The tables are rendered by fsdp_zero.tools.render.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from fsdp_zero.config import ZERO_STAGES, Quantize, Strategy, load_config
from fsdp_zero.data import BatchLayout
from fsdp_zero.model import construct, frozen_count, make_trainable
from fsdp_zero.monitor import parse_size
from fsdp_zero.sharding import build_wrap_plan
from fsdp_zero.tools import (
    DEFAULT_SEARCH,
    FIT_DIMENSIONS,
    FIT_MARGIN,
    FitSearch,
    PlanFacts,
    Trained,
    Workload,
    add_rate_flags,
    communication_table,
    fit_heading,
    fit_rates,
    fit_rates_line,
    fit_search,
    fit_table,
    formulas_table,
    given_rates,
    layout_rows,
    layout_table,
    memory_table,
    nf4_saving,
    offload_rates,
    plan_communication,
    script_parser,
    searched_overrides,
    simulate,
    tier_rows,
    tiers_table,
)

ALL = list(ZERO_STAGES.values())  # the ZeRO stages' strategies, stage 0 first


def run_formulas(args: argparse.Namespace) -> int:
    """`plan.py formulas`: the model-state formulas for --params, nothing built."""
    if args.params <= 0:
        raise ValueError(f"--params={args.params:g}: a count > 0")
    if args.largest_layer is not None and not 0 < args.largest_layer <= args.params:
        raise ValueError(
            f"--largest-layer={args.largest_layer:g}: the largest unit's parameters, > 0 and "
            f"<= --params={args.params:g}"
        )
    trained = Trained.given(args.params, args.frozen, args.nf4, args.state_bits)
    if not 0 <= args.offload_ratio <= 1:
        raise ValueError(
            f"--offload-ratio={args.offload_ratio:g}: a fraction of the groups, in [0, 1]"
        )
    if args.step_group_size < 0:
        raise ValueError(f"--step-group-size={args.step_group_size}: elements, >= 0 (0: one group)")
    largest = int(args.largest_layer) if args.largest_layer else None
    params, n, size = int(args.params), args.world_size, args.step_group_size
    print(formulas_table(params, largest, n, trained=trained))
    rows = tier_rows(params, n, size, args.offload_ratio, trained)
    print(tiers_table(rows, params, n, size))
    return 0


def run_layout(args: argparse.Namespace) -> int:
    """`plan.py layout`: tensor and pipeline parallel layouts by formula."""
    w = Workload.of(load_config(args.config, args.overrides))
    rows = layout_rows(w, args.world_size)
    print(layout_table(PlanFacts.of(w, args.world_size), rows))
    _write_json(args.json, [dataclasses.asdict(r) for r in rows])
    return 0


def run_simulate(args: argparse.Namespace) -> int:
    """`plan.py simulate`: each strategy's simulated peak, the formulas and the communication."""
    cfg, n = load_config(args.config, args.overrides), args.world_size
    if cfg.parallel.tp_size > 1 or cfg.parallel.pp_size > 1:
        raise ValueError(
            "parallel.tp_size/pp_size > 1: plan.py gives their layout by formula (no simulation): "
            "run `plan.py layout`, or search with `plan.py fit`"
        )
    rates = given_rates(args, cfg.dist.device.value)
    limit = parse_size(args.device_memory, "--device-memory") if args.device_memory else None
    preds = simulate(cfg, n, [Strategy(s) for s in args.strategy] if args.strategy else ALL)
    model = construct(cfg.model)  # meta parameters: free at any size
    make_trainable(model, cfg.model)  # model.freeze, model.lora: the formulas' frozen count
    plan = build_wrap_plan(model, cfg.parallel.wrap, n)
    num_params = sum(p.numel() for p in model.parameters())
    root = next(u.num_params for u in plan.units if not u.fqn)
    largest = max((u.num_params for u in plan.units if u.fqn), default=0)  # 0: the root alone
    nf4 = 0
    if cfg.model.lora.quantize is Quantize.nf4:
        nf4 = nf4_saving(cfg.model, cfg.parallel, cfg.precision, n)[0]
    trained = Trained(frozen_count(model), nf4, cfg.optim.state_bits)
    facts = PlanFacts.of(Workload.of(cfg), n)
    print(memory_table(facts, preds, num_params, limit))
    print(formulas_table(num_params, largest, n, root, trained))
    accum = BatchLayout.rounded(cfg.train, n).grad_accum_steps
    strategies = [Strategy(p.strategy) for p in preds]
    moved = plan_communication(cfg, model, plan, accum, strategies, rates.link_gbps)
    print(communication_table(facts, accum, moved, rates.link_gbps))
    drop = ("notes", "regions")  # (not JSON)
    _write_json(args.json, [{k: v for k, v in vars(p).items() if k not in drop} for p in preds])
    return 0


def run_fit(args: argparse.Namespace) -> int:
    """`plan.py fit`: the rates (the ones given, else `fsdp_zero.tools.fit.fit_rates`), the ranked
    candidates and the pick (fsdp_zero.tools.fit)."""
    dims = tuple(d for d in args.search.split(",") if d) if args.search else DEFAULT_SEARCH
    cfg = load_config(args.config, [*args.overrides, *searched_overrides(dims)])
    n, budget = args.world_size, parse_size(args.device_memory, "--device-memory")
    rates = given_rates(args, cfg.dist.device.value)
    if not 0 <= args.margin < 1:
        raise ValueError(f"--margin={args.margin:g}: a fraction of the predicted peak, in [0, 1)")
    if args.show < 1:
        raise ValueError(f"--show={args.show}: how many fitting candidates to print, >= 1")
    if budget <= 0:
        raise ValueError(f"--device-memory={args.device_memory}: a memory per rank > 0, e.g. 24GiB")
    print(fit_heading(PlanFacts.of(Workload.of(cfg), n), budget, args.margin), flush=True)
    given = any(getattr(args, k) is not None for k in ("tflops", "link_gbps", "host_gbps"))
    search = FitSearch(cfg, n, dims)
    rates = rates if given else fit_rates(search)
    links = {"host_gbps": args.host_gbps, "disk_gbps": args.disk_gbps}
    rates = offload_rates(search, rates, links)
    print(fit_rates_line(rates), flush=True)
    found = fit_search(search, rates)
    best = found.fit(budget, args.margin)
    print(fit_table(found, best, args.show, budget, args.margin))
    pick = {k: v for k, v in best.to_json().items() if k != "fits"}
    candidates = [s.to_json() for s in found.scored]
    _write_json(
        args.json,
        {"budget_bytes": budget, "margin": args.margin, "candidates": candidates, "pick": pick},
    )
    return 0


def _write_json(path: str | None, value: object) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(value, f, indent=2)


def _subcommand(subs: argparse._SubParsersAction, name: str, help: str, config: bool = True):  # noqa: ANN202
    """A subcommand's parser with --world-size, and with ``config``: --config, --json and key=value."""
    sub = subs.add_parser(
        name, help=help, description=help, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub.add_argument("--world-size", type=int, required=True)
    if config:
        sub.add_argument("--config")
        sub.add_argument("--json", help="also write the predictions here")
        sub.add_argument("overrides", nargs="*")
    return sub


def _formulas_flags(sub: argparse.ArgumentParser) -> None:
    sub.add_argument("--params", type=float, required=True, help="a parameter count (e.g. 7.5e9)")
    sub.add_argument(
        "--frozen",
        type=float,
        help="of them, the parameters that do not train (LoRA's base; default 0)",
    )
    sub.add_argument(
        "--nf4",
        type=float,
        help="of the frozen, those QLoRA stores in NF4 (0.516 B each; default 0)",
    )
    sub.add_argument(
        "--state-bits",
        type=int,
        choices=(32, 8, 4),
        default=32,
        help="bits per AdamW state value (optim.state_bits; default 32)",
    )
    sub.add_argument(
        "--largest-layer",
        type=float,
        help="the largest unit's parameters (DeepSpeed's estimate; default: none)",
    )
    sub.add_argument(
        "--step-group-size",
        type=int,
        default=0,
        help="elements per AdamW step group, the unit offload.states swaps "
        "(optim.step_group_size; default 0: the whole shard)",
    )
    sub.add_argument(
        "--offload-ratio",
        type=float,
        default=1.0,
        help="the fraction of step groups offload.states moves, the last ones (offload.ratio; "
        "default 1)",
    )


def _fit_flags(sub: argparse.ArgumentParser) -> None:
    sub.add_argument("--device-memory", required=True, help="memory per rank to fit in, e.g. 3GiB")
    add_rate_flags(sub)
    sub.add_argument(
        "--search",
        help=f"the settings to vary, comma-separated, of {','.join(FIT_DIMENSIONS)} "
        f"(default: {','.join(DEFAULT_SEARCH)}); the others stay as the config sets them",
    )
    sub.add_argument(
        "--margin",
        type=float,
        default=FIT_MARGIN,
        help=f"a candidate fits when its predicted peak plus this fraction of it does "
        f"(default {FIT_MARGIN:g}: the planner's measured accuracy)",
    )
    sub.add_argument(
        "--show", type=int, default=12, help="how many fitting candidates to print (default 12)"
    )


def parser() -> argparse.ArgumentParser:
    """plan.py's command line: one subcommand per table."""
    top = script_parser(__doc__)
    subs = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sim = _subcommand(subs, "simulate", "each strategy's peak, simulated; the formulas beside it")
    sim.add_argument(
        "--strategy",
        action="append",
        choices=[s.value for s in Strategy],
        help="repeatable; default: ddp, zero1, shard_grad_op, full_shard",
    )
    sim.add_argument("--device-memory", help="memory per rank to fit in, e.g. 80GB")
    add_rate_flags(sim, link_only=True)
    _formulas_flags(_subcommand(subs, "formulas", "the model-state formulas alone", config=False))
    _subcommand(subs, "layout", "tensor and pipeline parallel layouts by formula")
    _fit_flags(_subcommand(subs, "fit", "the cheapest setting that fits --device-memory"))
    return top


COMMANDS = {
    "simulate": run_simulate,
    "formulas": run_formulas,
    "layout": run_layout,
    "fit": run_fit,
}


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.world_size < 1:
            raise ValueError(f"--world-size={args.world_size}: must be >= 1")
        return COMMANDS[args.command](args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
