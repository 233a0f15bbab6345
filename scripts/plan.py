"""Predict per-rank memory before a run, for each strategy: no training, no GPU.

    python scripts/plan.py [--config configs/X.yaml] --world-size N [--strategy full_shard ...]
                           [--device-memory 80GB] [--json out.json] [key=value ...]
    python scripts/plan.py --params 7.5e9 --world-size 64     # formulas only, nothing built

Simulates one rank of N with fake tensors and a fake process group (fsdp_zero.planner),
then prints the peak by category, what a rank will show (on CPU: the process's peak RSS,
its measured baseline included; on CUDA: device memory), whether it fits
--device-memory, and for reference the ZeRO paper's model states per device (its Table 1)
beside each strategy's model state at rest and inside the step (fsdp_zero.planner's
`zero_paper_stages` and `strategy_states`), and DeepSpeed's ZeRO-3 estimate.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import torch

from fsdp_zero.build import construct
from fsdp_zero.config import ZERO_STAGES, Strategy
from fsdp_zero.config_loader import load_config
from fsdp_zero.lora import frozen_count, make_trainable
from fsdp_zero.memory import CATEGORIES, MIB, parse_size
from fsdp_zero.planner import (PAPER_K, PLAN_MODES, deepspeed_zero3_estimate, format_bytes, format_gb, simulate,
                               strategy_states, zero_paper_stages)
from fsdp_zero.wrap import build_wrap_plan

ALL = list(ZERO_STAGES.values())  # the ZeRO stages' strategies, stage 0 first


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config")
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--strategy", action="append", choices=[s.value for s in Strategy],
                        help="repeatable; default: ddp, zero1, shard_grad_op, full_shard")
    parser.add_argument("--device-memory", help="memory per rank to fit in, e.g. 80GB")
    parser.add_argument("--json", help="also write the predictions here")
    parser.add_argument("--params", type=float, help="a parameter count (e.g. 7.5e9): the ZeRO formulas only")
    parser.add_argument("--largest-layer", type=float, help="with --params: the largest unit's parameters "
                        "(DeepSpeed's estimate; default: none)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    try:
        if args.world_size < 1:
            raise ValueError(f"--world-size={args.world_size}: must be >= 1")
        if args.params is not None:
            if args.params <= 0 or args.config or args.overrides or args.strategy:
                raise ValueError(f"--params={args.params:g}: a count > 0, with --world-size alone (no config, "
                                 "no strategies: nothing is built)")
            if args.largest_layer is not None and not 0 < args.largest_layer <= args.params:
                raise ValueError(f"--largest-layer={args.largest_layer:g}: the largest unit's parameters, > 0 and "
                                 f"<= --params={args.params:g}")
            formulas(int(args.params), int(args.largest_layer) if args.largest_layer else None, args.world_size)
            return 0
        cfg = load_config(args.config, args.overrides)
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
    cuda = cfg.dist.device.value == "cuda"
    kind = "device memory" if cuda else "peak RSS (process)"
    if cuda and not torch.cuda.is_available():
        print("(no GPU visible: the step was simulated on the CPU; tensor sizes are the same, CUDA kernels'"
              " workspaces are not included)\n")
    print(f"# memory plan: {cfg.model.target or cfg.model.preset}, {num_params:,} parameters, {n} ranks, "
          f"micro-batch {cfg.train.micro_batch_size} x {cfg.data.seq_len} tokens, {cfg.precision.mode} AdamW"
          + (", CPU offload" if cfg.parallel.cpu_offload else "") + "\n")
    retained = "" if cuda else "heap kept MiB"  # what glibc's heap keeps beyond the live tensors
    head = ["strategy"] + [f"{c} MiB" for c in CATEGORIES] + ["tensors MiB", "baseline MiB"] + [retained] * (not cuda)
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
    if cfg.parallel.cpu_offload:
        print("CPU offload: the model state (sharded parameters, gradients, AdamW states) lives in host memory"
              + ("; device memory is the tensors less that" if cuda else "") + ": "
              + "; ".join(f"{p.strategy} {p.host_state / MIB:,.1f} MiB" for p in preds) + " per rank\n")
    formulas(num_params, largest, n, root, frozen_count(model))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{k: v for k, v in dataclasses.asdict(p).items() if k != "notes"} for p in preds], f, indent=2)
    return 0


def formulas(num_params: int, largest: int | None, n: int, root: int | None = None, frozen: int = 0) -> None:
    """The ZeRO paper's model states per device (its Table 1) beside ours per strategy, at rest and
    inside the step, and DeepSpeed's ZeRO-3 estimate. ``largest``: the largest unit's parameters
    besides the root (None: not known); ``root``: the root unit's own (None: not known, counted as 0)."""
    paper = zero_paper_stages(num_params, n)
    states = strategy_states(num_params, n, largest, root or 0, frozen=frozen)
    print(f"## model states per rank, {num_params:,} parameters over {n} ranks: the ZeRO paper and ours\n")
    print(f"- ZeRO paper (Rajbhandari et al. 2020), Table 1, as it states them: mixed-precision Adam (fp16 parameters "
          f"2 B, fp16 gradients 2 B, K = {PAPER_K} B of fp32 optimizer states per parameter), Psi parameters over N_d "
          "ranks, GB = 10^9 bytes.")
    print("- ours, AdamW, GiB = 2^30 bytes (MiB = 2^20): at rest = after the optimizer step; in step = at rest + the "
          "parameters held gathered, in the compute dtype, between forward and backward: shard_grad_op every unit, "
          "full_shard " + ("one or two units (--largest-layer gives their size)" if largest is None else
                           f"2 x the largest unit ({largest:,} parameters: one computing, the next prefetched)"
                           + (f" + the root unit ({root:,}, kept gathered for backward)" if root is not None
                              else " (+ the root unit's own parameters, kept gathered for backward: not known here)"))
          + ", ddp and zero1 nothing beyond their whole copy.")
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
                in_step = format_bytes(s.at_rest) + " + 1-2 units" if s.in_step is None else format_bytes(s.in_step)
                cells += [format_bytes(s.at_rest), in_step]
        print("| " + " | ".join(cells) + " |")
    for mode in PLAN_MODES:  # one line per mode: the reasons differ only in the strategy they name
        refused = [s for s in states if s.mode == mode and s.refused]
        if refused:
            print(f"\nrefused ({mode} with {', '.join(s.strategy.value for s in refused)}): {refused[0].refused}")
    biggest = largest or root or 0  # DeepSpeed's largest layer: the largest unit besides the root, or the root alone
    layer = f"largest layer {biggest:,} params" if biggest else "largest layer not given, counted as 0"
    print(f"\nDeepSpeed estimate_zero3_model_states_mem_needs (no offload; {layer}): "
          f"{format_bytes(deepspeed_zero3_estimate(num_params, biggest, n))} per GPU")


if __name__ == "__main__":
    sys.exit(main())
