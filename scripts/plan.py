"""Predict per-rank memory before a run, for each strategy: no training, no GPU.

    python scripts/plan.py [--config configs/X.yaml] --world-size N [--strategy full_shard ...]
                           [--device-memory 80GB] [--json out.json] [key=value ...]
    python scripts/plan.py --params 7.5e9 --world-size 64     # formulas only, nothing built
    python scripts/plan.py [--config X.yaml] --world-size N --fit 3GiB [--json F] [--link-gbps G] [key=value ...]

Simulates one rank of N with fake tensors and a fake process group (fsdp_zero.tools.planner),
then prints the peak by category, what a rank will show (on CPU: the process's peak RSS,
its measured baseline included; on CUDA: device memory), whether it fits
--device-memory, and for reference the ZeRO paper's model states per device (its Table 1)
beside each strategy's model state at rest and inside the step (fsdp_zero.tools.planner's
`zero_paper_stages` and `strategy_states`), DeepSpeed's ZeRO-3 estimate, and the bytes each
strategy and precision mode communicates per step (fsdp_zero.monitor.comm) with their time at --link-gbps.

--fit searches strategy x precision x activation checkpointing x CPU offload x micro-batch x
parallel.grad_sync (fsdp_zero.tools.fit), and with `--search ...,layout` every parallel.tp_size x
parallel.pp_size too (their peaks and costs by formula, fsdp_zero.tools.layout), and prints the
candidates ranked by a relative step cost, and the cheapest that fits as key=value overrides to paste
onto the training command line.

With parallel.tp_size or parallel.pp_size > 1 and no --fit, it prints their layout by formula
instead of simulating (fsdp_zero.tools.layout).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import torch

from fsdp_zero.config import ZERO_STAGES, Config, Quantize, Strategy, load_config, validate
from fsdp_zero.data import BatchLayout
from fsdp_zero.distributed import Topology
from fsdp_zero.model import construct, frozen_count, make_trainable
from fsdp_zero.monitor import CATEGORIES, MIB, comm_formula, comm_seconds, parse_size
from fsdp_zero.sharding import build_wrap_plan, nf4_bytes, resolve
from fsdp_zero.tools import (
    DEFAULT_SEARCH,
    DIMENSIONS,
    MARGIN,
    PAPER_K,
    PLAN_MODES,
    Prediction,
    Rates,
    StageRow,
    Trained,
    deepspeed_zero3_estimate,
    fit_rates,
    format_bytes,
    format_gb,
    layout_rows,
    nf4_saving,
    script_parser,
    search,
    searched_overrides,
    simulate,
    strategy_states,
    zero_paper_stages,
)

ALL = list(ZERO_STAGES.values())  # the ZeRO stages' strategies, stage 0 first


def main(argv: list[str] | None = None) -> int:
    parser = script_parser(__doc__)
    parser.add_argument("--config")
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument(
        "--strategy",
        action="append",
        choices=[s.value for s in Strategy],
        help="repeatable; default: ddp, zero1, shard_grad_op, full_shard",
    )
    parser.add_argument("--device-memory", help="memory per rank to fit in, e.g. 80GB")
    parser.add_argument("--json", help="also write the predictions here")
    parser.add_argument(
        "--params", type=float, help="a parameter count (e.g. 7.5e9): the ZeRO formulas only"
    )
    parser.add_argument(
        "--frozen",
        type=float,
        help="with --params: of them, the parameters that do not train (LoRA's base; default 0)",
    )
    parser.add_argument(
        "--nf4",
        type=float,
        help="with --params: of the frozen, those QLoRA stores in NF4 (0.516 B each; default 0)",
    )
    parser.add_argument(
        "--state-bits",
        type=int,
        choices=(32, 8, 4),
        help="with --params: bits per AdamW state value (optim.state_bits; default 32)",
    )
    parser.add_argument(
        "--largest-layer",
        type=float,
        help="with --params: the largest unit's parameters (DeepSpeed's estimate; default: none)",
    )
    parser.add_argument(
        "--fit",
        help="memory per rank to fit in, e.g. 3GiB: search the settings, print the cheapest that fits",
    )
    parser.add_argument(
        "--link-gbps",
        type=float,
        help="per-rank collective bandwidth, Gbit/s (default: 400 for dist.device=cuda, 20 for cpu)",
    )
    parser.add_argument(
        "--tflops",
        type=float,
        help="--fit: achieved 16-bit compute per rank, TFLOP/s (default: 400 for cuda, 0.05 for cpu)",
    )
    parser.add_argument(
        "--host-gbps",
        type=float,
        help="--fit: host <-> device copies (CPU offload), Gbit/s (default 200)",
    )
    parser.add_argument(
        "--search",
        help=f"--fit: the settings to vary, comma-separated, of {','.join(DIMENSIONS)} "
        f"(default: {','.join(DEFAULT_SEARCH)}); the others stay as the config sets them",
    )
    parser.add_argument(
        "--margin",
        type=float,
        help=f"--fit: a candidate fits when its predicted peak plus this "
        f"fraction of it does (default {MARGIN:g}: the planner's measured accuracy)",
    )
    parser.add_argument(
        "--show", type=int, help="--fit: how many fitting candidates to print (default 12)"
    )
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    try:
        if args.world_size < 1:
            raise ValueError(f"--world-size={args.world_size}: must be >= 1")
        if args.params is not None:
            if args.params <= 0 or args.config or args.overrides or args.strategy:
                raise ValueError(
                    f"--params={args.params:g}: a count > 0, with --world-size alone (no config, "
                    "no strategies: nothing is built)"
                )
            if args.largest_layer is not None and not 0 < args.largest_layer <= args.params:
                raise ValueError(
                    f"--largest-layer={args.largest_layer:g}: the largest unit's parameters, > 0 and "
                    f"<= --params={args.params:g}"
                )
            frozen, nf4 = int(args.frozen or 0), int(args.nf4 or 0)
            if not 0 <= nf4 <= frozen <= args.params:
                raise ValueError(
                    f"--frozen={frozen:g}, --nf4={nf4:g}: 0 <= --nf4 <= --frozen <= "
                    f"--params={args.params:g} (NF4 stores frozen parameters only)"
                )
            formulas(
                int(args.params),
                int(args.largest_layer) if args.largest_layer else None,
                args.world_size,
                trained=Trained(frozen, nf4, args.state_bits or 32),
            )
            return 0
        for flag in ("frozen", "nf4", "state_bits"):
            if getattr(args, flag) is not None:
                raise ValueError(
                    f"--{flag.replace('_', '-')}={getattr(args, flag):g}: it applies to --params (with "
                    "a config, the config's and the model's own are used)"
                )
        for flag in ("search", "margin", "show", "tflops", "host_gbps"):
            if getattr(args, flag) is not None and not args.fit:
                raise ValueError(
                    f"--{flag.replace('_', '-')}={getattr(args, flag)}: it applies to --fit; add --fit MEMORY"
                )
        dims = tuple(d for d in args.search.split(",") if d) if args.search else DEFAULT_SEARCH
        cfg = load_config(
            args.config, [*args.overrides, *(searched_overrides(dims) if args.fit else [])]
        )
        if (cfg.parallel.tp_size > 1 or cfg.parallel.pp_size > 1) and not args.fit:
            if args.strategy or args.device_memory:
                raise ValueError(
                    "parallel.tp_size/pp_size > 1: plan.py gives their layout by formula (no "
                    "simulation): drop --strategy and --device-memory, or search with --fit"
                )
            rows = layout_rows(cfg, args.world_size)
            layout_table(cfg, rows, args.world_size)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump([dataclasses.asdict(r) for r in rows], f, indent=2)
            return 0
        rates = _rates(args, cfg.dist.device.value)
        if args.fit:
            if args.strategy or args.device_memory:
                raise ValueError(
                    "--fit searches every strategy against its own budget: drop --strategy and --device-memory"
                )
            margin, show, budget = (
                MARGIN if args.margin is None else args.margin,
                12 if args.show is None else args.show,
                parse_size(args.fit, "--fit"),
            )
            if not 0 <= margin < 1:
                raise ValueError(
                    f"--margin={margin:g}: a fraction of the predicted peak, in [0, 1)"
                )
            if show < 1:
                raise ValueError(f"--show={show}: how many fitting candidates to print, >= 1")
            if budget <= 0:
                raise ValueError(f"--fit={args.fit}: a memory per rank > 0, e.g. 24GiB")
            given = any(getattr(args, k) is not None for k in ("tflops", "link_gbps", "host_gbps"))
            return fit(
                cfg,
                args.world_size,
                budget,
                margin,
                None if not given else rates,
                dims,
                args.json,
                show,
            )
        limit = parse_size(args.device_memory, "--device-memory") if args.device_memory else None
        strategies = [Strategy(s) for s in args.strategy] if args.strategy else ALL
        preds = simulate(cfg, args.world_size, strategies)
        model = construct(cfg.model)  # meta parameters: free at any size
        make_trainable(model, cfg.model)  # model.freeze, model.lora: the formulas' frozen count
        units = build_wrap_plan(model, cfg.parallel.wrap, args.world_size).units
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    num_params = sum(p.numel() for p in model.parameters())
    root = next(u.num_params for u in units if not u.fqn)
    largest = max((u.num_params for u in units if u.fqn), default=0)  # 0: the root is the only unit
    n = args.world_size
    memory_table(cfg, preds, num_params, n, limit)
    nf4 = nf4_saving(cfg, n)[0] if cfg.model.lora.quantize is Quantize.nf4 else 0
    formulas(num_params, largest, n, root, Trained(frozen_count(model), nf4, cfg.optim.state_bits))
    communication(cfg, model, n, [Strategy(p.strategy) for p in preds], rates.link_gbps)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                [
                    {
                        k: v
                        for k, v in dataclasses.asdict(p).items()
                        if k not in ("notes", "regions")
                    }
                    for p in preds
                ],
                f,
                indent=2,
            )
    return 0


def layout_table(cfg: Config, rows: list[StageRow], n: int) -> None:
    """Tensor and pipeline parallel layouts: each pipeline rank's stages, their parameters, the model
    state per rank after a step (what the run's end-of-run line compares with), the activations it
    holds at its schedule's peak, and under pipeline parallelism what a stage holds inside a step
    and sends across a boundary (fsdp_zero.tools.layout)."""
    p = cfg.parallel
    print(
        f"# layout by formula: {cfg.model.target or cfg.model.preset}, {n} ranks = pp {p.pp_size} x "
        f"dp {n // (p.pp_size * p.tp_size)} x tp {p.tp_size}, {cfg.parallel.strategy.value}, "
        f"{cfg.precision.mode} AdamW, micro-batch {cfg.train.micro_batch_size}"
        + (f", {p.pp_schedule}" if p.pp_size > 1 else "")
        + " (no simulation runs a pipeline or tensor parallelism: --fit --search layout composes "
        "these with one that does)\n"
    )
    print(
        "| pipeline rank | stages | parameters | left whole by tp | model state MiB/rank | "
        "activations MiB/rank | held in the step MiB/rank | boundary MiB/micro-batch |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r.pp_rank} | {', '.join(map(str, r.stages))} | {r.params:,} | {r.whole:,} | "
            f"{r.model_state / MIB:,.4f} | {r.activations / MIB:,.1f} | {r.held_in_step / MIB:,.4f} | "
            + (f"{r.boundary / MIB:,.4f} |" if r.boundary is not None else "- |")
        )
    print(
        "\nactivations: what autograd saves for backward in a micro-batch's forward and loss (the meta "
        "device, one tp rank's shapes), times the micro-batches the schedule holds at once"
    )


def memory_table(
    cfg: Config, preds: list[Prediction], num_params: int, n: int, limit: int | None
) -> None:
    """Each strategy's predicted peak by category, what a rank will show, and whether it fits ``limit``."""
    cuda = cfg.dist.device.value == "cuda"
    kind = "device memory" if cuda else "peak RSS (process)"
    if cuda:
        print(
            "(the step is simulated on the CPU: tensor sizes are the same, CUDA kernels' workspaces are not included)\n"
        )
    print(
        f"# memory plan: {cfg.model.target or cfg.model.preset}, {num_params:,} parameters, {n} ranks, "
        f"micro-batch {cfg.train.micro_batch_size} x {cfg.data.seq_len} tokens, {cfg.precision.mode} AdamW"
        + (", CPU offload" if cfg.parallel.cpu_offload else "")
        + "\n"
    )
    retained = "" if cuda else "heap kept MiB"  # what glibc's heap keeps beyond the live tensors
    head = (
        ["strategy"]
        + [f"{c} MiB" for c in CATEGORIES]
        + ["tensors MiB", "baseline MiB"]
        + [retained] * (not cuda)
    )
    head += [f"{kind} MiB", "model state MiB"]
    if limit:
        head.append(f"fits {format_bytes(limit)}")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for p in preds:
        cells = [p.strategy] + [f"{p.tensors[c] / MIB:,.1f}" for c in CATEGORIES]
        tensors = sum(p.tensors.values())
        cells += [f"{tensors / MIB:,.1f}", f"{p.baseline / MIB:,.0f}"]
        cells += [f"{(p.peak - p.baseline - tensors) / MIB:,.0f}"] * (not cuda)
        cells += [f"{p.peak / MIB:,.0f}", f"{p.model_state / MIB:,.1f}"]
        if limit:
            cells.append("yes" if p.peak <= limit else f"no (needs {format_bytes(p.peak)})")
        print("| " + " | ".join(cells) + " |")
    print()
    # a composed simulation says so (fsdp_zero.tools.planner)
    for note in sorted({n for p in preds for n in p.notes}):
        print(f"({note})\n")
    if cfg.parallel.cpu_offload:
        print(
            "CPU offload: the model state (sharded parameters, gradients, AdamW states) lives in host memory"
            + ("; device memory is the tensors less that" if cuda else "")
            + ": "
            + "; ".join(f"{p.strategy} {p.host_state / MIB:,.1f} MiB" for p in preds)
            + " per rank\n"
        )


def _rates(args: argparse.Namespace, device: str) -> Rates:
    given = {"tflops": args.tflops, "link_gbps": args.link_gbps, "host_gbps": args.host_gbps}
    for key, value in given.items():
        if value is not None and not value > 0:
            raise ValueError(f"--{key.replace('_', '-')}={value:g}: must be > 0")
    return dataclasses.replace(
        Rates.default(device), **{k: v for k, v in given.items() if v is not None}
    )


def communication(
    cfg: Config, model: torch.nn.Module, n: int, strategies: list[Strategy], link_gbps: float
) -> None:
    """Bytes per rank per optimizer step by kind (`fsdp_zero.monitor.comm.comm_formula`), for each strategy and
    precision mode, and the time they take at ``link_gbps``."""
    plan = build_wrap_plan(model, cfg.parallel.wrap, n)
    accum = BatchLayout.rounded(cfg.train, n).grad_accum_steps
    print(
        f"\n## communication per rank per optimizer step ({accum} micro-batches, parallel.grad_sync="
        f"{cfg.parallel.grad_sync.value}; time at {link_gbps:g} Gbit/s, ring collectives)\n"
    )
    print(
        "| strategy | precision | all-gather MiB | reduce-scatter MiB | all-reduce MiB | time ms |"
    )
    print("|---|---|---|---|---|---|")
    for strategy in strategies:
        for mode in PLAN_MODES:
            c = dataclasses.replace(
                cfg,
                parallel=dataclasses.replace(cfg.parallel, strategy=strategy),
                precision=dataclasses.replace(cfg.precision, mode=mode),
            )
            try:
                validate(c)
            except ValueError:  # e.g. bf16-mixed under DDP; grad_sync=once_per_step under DDP
                continue
            topology = Topology.of(c.parallel, n)
            moved = comm_formula(c, topology, model, plan, accum, resolve(c.precision))
            seconds = sum(comm_seconds(moved, topology, link_gbps).values())
            print(
                f"| {strategy.value} | {mode} | {moved.all_gather / MIB:,.1f} | {moved.reduce_scatter / MIB:,.1f} | "
                f"{moved.all_reduce / MIB:,.1f} | {seconds * 1e3:,.1f} |"
            )


def fit(
    cfg: Config,
    n: int,
    budget: int,
    margin: float,
    rates: Rates | None,
    dims: tuple[str, ...],
    json_path: str | None,
    show: int,
) -> int:
    """--fit: the rates (``rates``: the ones given; None: `fsdp_zero.tools.fit.fit_rates`), the ranked candidates
    and the pick (fsdp_zero.tools.fit)."""
    print(
        f"# fit: {cfg.model.pretrained or cfg.model.target or cfg.model.preset}, {n} ranks, global batch "
        f"{cfg.train.global_batch_size}, budget {format_bytes(budget)} per rank "
        f"({'device memory' if cfg.dist.device.value == 'cuda' else 'peak RSS'}); a candidate fits when its "
        f"predicted peak + {margin:.0%} does",
        flush=True,
    )
    rates = rates or fit_rates(cfg, n, dims)
    print(
        f"rates: {rates.describe()}\ncost = compute + communication + optimizer step + offload copies, no overlap\n",
        flush=True,
    )
    found = search(cfg, n, rates, dims)
    best = found.fit(budget, margin)
    scored = found.scored
    fitting = [s for s in scored if s.fits]
    print(
        f"{len(scored)} candidates ({found.simulations} simulations, {found.seconds:.0f} s), {len(fitting)} fit; "
        f"the {min(show, len(fitting))} cheapest that fit:\n"
    )
    print(
        "| # | cost ms | compute ms | comm ms | optimizer ms | offload ms | peak | strategy | precision | "
        "checkpointing | offload | micro-batch | grad_sync | tp | pp |"
    )
    print("|" + "---|" * 15)
    for i, s in enumerate(fitting[:show], start=1):
        c, part = s.candidate, s.parts.get
        ms = [
            f"{v * 1e3:,.1f}"
            for v in (
                s.cost,
                part("compute_s", 0) + part("bubble_s", 0),  # a pipeline's bubble is idle compute
                part("comm_s", 0) + part("tp_comm_s", 0) + part("p2p_s", 0),
                part("optimizer_s", 0),
                part("offload_s", 0),
            )
        ]
        print(
            f"| {i} | {' | '.join(ms)} "
            f"| {format_bytes(s.peak)} | {c.strategy.value} | {c.precision} | {c.checkpointing.value} | "
            f"{'yes' if c.offload else 'no'} | {c.micro_batch} | {c.grad_sync.value} | {c.tp} | {c.pp} |"
        )
    print(
        f"\npick: cost {best.cost * 1e3:,.1f} ms, peak {format_bytes(best.peak)} (+ {margin:.0%}: "
        f"{format_bytes(best.peak * (1 + margin))}) of {format_bytes(budget)}:"
    )
    print("  " + " ".join(best.candidate.overrides()))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(
                {
                    "budget_bytes": budget,
                    "margin": margin,
                    "candidates": [s.to_json() for s in scored],
                    "pick": {k: v for k, v in best.to_json().items() if k != "fits"},
                },
                f,
                indent=2,
            )
    return 0


def formulas(
    num_params: int,
    largest: int | None,
    n: int,
    root: int | None = None,
    trained: Trained = Trained(),
) -> None:
    """The ZeRO paper's model states per device (its Table 1) beside ours per strategy, at rest and
    inside the step, and DeepSpeed's ZeRO-3 estimate. ``largest``: the largest unit's parameters
    besides the root (None: not known); ``root``: the root unit's own (None: not known, counted as 0);
    ``trained``: frozen, NF4 and the AdamW states' bits."""
    frozen, nf4, state_bits = trained.frozen, trained.nf4, trained.state_bits
    paper = zero_paper_stages(num_params, n)
    states = strategy_states(num_params, n, largest, root or 0, trained=trained)
    print(
        f"## model states per rank, {num_params:,} parameters over {n} ranks: the ZeRO paper and ours\n"
    )
    print(
        f"- ZeRO paper (Rajbhandari et al. 2020), Table 1, as it states them: mixed-precision Adam (fp16 parameters "
        f"2 B, fp16 gradients 2 B, K = {PAPER_K} B of fp32 optimizer states per parameter), Psi parameters over N_d "
        "ranks, GB = 10^9 bytes."
    )
    print(
        "- ours, AdamW, GiB = 2^30 bytes (MiB = 2^20): at rest = after the optimizer step; in step = at rest + the "
        "parameters held gathered, in the compute dtype, between forward and backward: shard_grad_op every unit, "
        "full_shard "
        + (
            "one or two units (--largest-layer gives their size)"
            if largest is None
            else f"2 x the largest unit ({largest:,} parameters: one computing, the next prefetched)"
            + (
                f" + the root unit ({root:,}, kept gathered for backward)"
                if root is not None
                else " (+ the root unit's own parameters, kept gathered for backward: not known here)"
            )
        )
        + ", ddp and zero1 nothing beyond their whole copy."
    )
    if frozen:
        print(
            f"- {frozen:,} of the parameters frozen (LoRA's base, model.freeze): their weights only, no "
            "gradients or AdamW states"
            + (
                f"; {nf4:,} of those in NF4 (QLoRA): {nf4_bytes(nf4) / nf4:.4f} B each instead of the "
                "stored dtype's, / N (the FSDP strategies only)"
                if nf4
                else ""
            )
            + "."
        )
    if state_bits != 32:
        print(
            f"- AdamW states in {state_bits} bits (optim.state_bits, torchao): "
            f"{2 * (state_bits / 8 + 4 / {8: 256, 4: 128}[state_bits]):.4f} B a trained parameter instead of "
            "8 (shards under 4,096 values keep 8)."
        )
    print("- fp16-mixed: as bf16-mixed (the same bytes).\n")
    head = ["ZeRO", "paper stage", "paper formula", "paper"]
    head += ["ours"] + [f"{m} {when}" for m in PLAN_MODES for when in ("at rest", "in step")]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for stage, p in paper.items():
        row = [s for s in states if s.stage == stage]
        cells = [str(stage), p.name, p.formula, format_gb(p.bytes), row[0].strategy.value]
        for s in row:
            if s.refused:
                cells += ["refused"] * 2
            else:
                in_step = (
                    format_bytes(s.at_rest) + " + 1-2 units"
                    if s.in_step is None
                    else format_bytes(s.in_step)
                )
                cells += [format_bytes(s.at_rest), in_step]
        print("| " + " | ".join(cells) + " |")
    for mode in PLAN_MODES:  # one line per mode: the reasons differ only in the strategy they name
        refused = [s for s in states if s.mode == mode and s.refused]
        if refused:
            print(
                f"\nrefused ({mode} with {', '.join(s.strategy.value for s in refused)}): {refused[0].refused}"
            )
    # DeepSpeed's largest layer: the largest unit besides the root, or the root alone
    biggest = largest or root or 0
    layer = (
        f"largest layer {biggest:,} params" if biggest else "largest layer not given, counted as 0"
    )
    print(
        f"\nDeepSpeed estimate_zero3_model_states_mem_needs (no offload; {layer}): "
        f"{format_bytes(deepspeed_zero3_estimate(num_params, biggest, n))} per GPU"
    )


if __name__ == "__main__":
    sys.exit(main())
