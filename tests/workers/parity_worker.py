"""Trains any configured model through fsdp_zero.trainer and saves what the parity tests compare.

    torchrun --nproc_per_node=N tests/workers/parity_worker.py OUT.pt [--config X.yaml] key=value ...

OUT.pt (rank 0): per-step losses, grad norms and learning rates, the full weights before and after
training, the final model's logits on a fixed batch (the data's first two samples), every rank's
model-state bytes after the first optimizer step, the wrap plan's padded shard bytes per rank, and
whether gloo runs' reduce-scatter (`AllReduceScatter`) equals gloo's own bit for bit on this group.
"""

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from fsdp_zero.config import load_config
from fsdp_zero.distributed import distributed, exit_process
from fsdp_zero.parallelize import AllReduceScatter
from fsdp_zero.tasks import logits_of
from fsdp_zero.trainer import setup, train


def full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    # Cloned: at world size 1 on CPU the "full" tensors alias the live parameters.
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.clone() for k, v in full.items()}


def reduce_scatter_matches_gloo(world_size: int, rank: int) -> bool:
    """Our all-reduce form against gloo's reduce-scatter, on values spanning 12 orders of magnitude."""
    equal = True
    for op in (dist.ReduceOp.AVG, dist.ReduceOp.SUM):
        numel = world_size * 100_003
        x = torch.randn(numel, generator=torch.Generator().manual_seed(rank)) * torch.logspace(-6, 6, numel)
        ours, theirs = torch.empty(numel // world_size), torch.empty(numel // world_size)
        AllReduceScatter()(ours, x.clone(), dist.group.WORLD, op)
        dist.reduce_scatter_tensor(theirs, x.clone(), op=op)
        equal &= torch.equal(ours, theirs)
    flag = torch.tensor(int(equal))
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag)


def main() -> None:
    out, overrides = sys.argv[1], sys.argv[2:]
    path = None
    if overrides[:1] == ["--config"]:
        path, overrides = overrides[1], overrides[2:]
    cfg = load_config(path, overrides)
    with distributed(cfg.dist) as env:
        parts = setup(cfg, env)
        initial = full_weights(parts.model)
        result = train(cfg, env, parts)
        final = full_weights(parts.model)
        with torch.no_grad():  # the sharded model's outputs on a fixed batch
            inputs = parts.cursor.source.batch(range(2))[0]
            logits = logits_of(parts.model(inputs.to(env.device))).cpu()
        same_reduce_scatter = reduce_scatter_matches_gloo(env.world_size, env.rank) if env.backend == "gloo" else None
        # Every rank's model state, and the optimizer steps its AdamW states counted (skipped fp16 steps not).
        opt_states = parts.optimizer.state.values()
        mine = (result.model_state_bytes, sorted({int(st["step"]) for st in opt_states}),
                sorted({str(st["exp_avg"].dtype) for st in opt_states}))
        states = [None] * env.world_size
        dist.all_gather_object(states, mine)
        if env.is_rank0:
            log = [json.loads(line) for line in (parts.run_dir / "metrics.jsonl").read_text().splitlines()]
            lrs = {row["step"]: row["lr"] for row in log}  # the rate each logged step used
            torch.save({"losses": result.losses, "grad_norms": result.grad_norms, "lrs": lrs, "initial": initial,
                        "final": final, "logits": logits, "model_state_bytes": [b for b, _, _ in states],
                        "adam_steps": [n for _, n, _ in states], "adam_dtypes": [d for _, _, d in states], "breakdown": result.breakdown,
                        "phases": {phase.value: dict(cats) for phase, cats in result.phases.items()},
                        "dtypes": sorted({str(v.dtype) for v in final.values() if v.is_floating_point()}),
                        "loss_scale": {r["step"]: r["loss_scale"] for r in log if "loss_scale" in r},
                        "skipped_steps": {r["step"]: r["skipped_steps"] for r in log if "skipped_steps" in r}, "num_params": parts.num_params,
                        "shard_bytes": [u.bytes_per_rank for u in parts.plan.units],
                        "same_reduce_scatter": same_reduce_scatter}, out)


if __name__ == "__main__":
    main()
    exit_process(0)
