"""Predict per-rank memory before a run, for each strategy: no training, no GPU.

    python scripts/plan.py [--config configs/X.yaml] --world-size N [--strategy full_shard ...]
                           [--device-memory 80GB] [--json out.json] [key=value ...]
    python scripts/plan.py --params 7.5e9 --world-size 64     # formulas only, nothing built

Simulates one rank of N with fake tensors and a fake process group (fsdp_zero.planner),
then prints the peak by category, what a rank will show (on CPU: the process's peak RSS,
its measured baseline included; on CUDA: device memory), whether it fits
--device-memory, and for reference the ZeRO paper's model-state formulas and DeepSpeed's
ZeRO-3 estimate for this parameter count.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import torch

from fsdp_zero.build import construct
from fsdp_zero.config import Strategy, load_config
from fsdp_zero.memory import CATEGORIES, MIB
from fsdp_zero.planner import deepspeed_zero3_estimate, format_bytes, simulate, zero_formulas
from fsdp_zero.weights import parse_size
from fsdp_zero.wrap import build_wrap_plan

ALL = [Strategy.ddp, Strategy.zero1, Strategy.shard_grad_op, Strategy.full_shard]


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
            formulas(int(args.params), int(args.largest_layer or 0), args.world_size)
            return 0
        cfg = load_config(args.config, args.overrides)
        limit = parse_size(args.device_memory) if args.device_memory else None
        strategies = [Strategy(s) for s in args.strategy] if args.strategy else ALL
        preds = simulate(cfg, args.world_size, strategies)
        model = construct(cfg.model)  # meta parameters: free at any size
        units = build_wrap_plan(model, cfg.parallel.wrap, args.world_size).units
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    num_params = sum(p.numel() for p in model.parameters())
    largest = max((u.num_params for u in units if u.fqn), default=units[-1].num_params)  # the root when alone
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
    formulas(num_params, largest, n)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{k: v for k, v in dataclasses.asdict(p).items() if k != "notes"} for p in preds], f, indent=2)
    return 0


def formulas(num_params: int, largest: int, n: int) -> None:
    """The ZeRO paper's model-state bytes per rank, and DeepSpeed's ZeRO-3 estimate."""
    print(f"ZeRO paper, model states per rank for {num_params:,} parameters over {n} ranks "
          "(parameters, gradients, optimizer states):")
    for precision, rows in zero_formulas(num_params, n).items():
        print(f"  {precision}: " + "; ".join(f"{k} {format_bytes(v)}" for k, v in rows.items()))
    print(f"DeepSpeed estimate_zero3_model_states_mem_needs (no offload; largest layer {largest:,} params): "
          f"{format_bytes(deepspeed_zero3_estimate(num_params, largest, n))} per GPU")


if __name__ == "__main__":
    sys.exit(main())
