"""Prototype (not part of the package yet): the built-in model at pp 2 (1F1B) against one process.

python -m torch.distributed.run --standalone --nproc_per_node=2 dev/pp_proto.py
"""

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

from fsdp_zero.config import load_config
from fsdp_zero.model import construct
from fsdp_zero.sharding.pipeline import keep_stage

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
cfg = load_config(None, ["model.preset=gpt_nano", "model.n_layers=4"])
torch.manual_seed(0)
full = construct(cfg.model).to_empty(device="cpu")
full.init_weights(1234)
tokens = torch.randint(0, 256, (8, 33), generator=torch.Generator().manual_seed(1))
x, y = tokens[:, :-1], tokens[:, 1:]


def loss_fn(out, target):
    return F.cross_entropy(out.flatten(0, 1).float(), target.flatten())


# one process: the whole batch as 4 micro-batches of 2, gradients averaged
ref = copy.deepcopy(full)
opt = torch.optim.AdamW(ref.parameters(), lr=3e-3)
ref_losses = []
for _ in range(3):
    loss = sum(loss_fn(ref(x[i : i + 2]), y[i : i + 2]) / 4 for i in range(0, 8, 2))
    loss.backward()
    opt.step()
    opt.zero_grad()
    ref_losses.append(loss.item())

stage_model = keep_stage(copy.deepcopy(full), rank, world)
stage = PipelineStage(stage_model, rank, world, torch.device("cpu"))
schedule = Schedule1F1B(stage, n_microbatches=4, loss_fn=loss_fn)
opt = torch.optim.AdamW(stage_model.parameters(), lr=3e-3)
for step in range(3):
    losses = []
    if rank == 0:
        schedule.step(x)
    else:
        schedule.step(target=y, losses=losses)
    opt.step()
    opt.zero_grad()
    if rank == world - 1:
        got = sum(v.item() for v in losses) / len(losses)
        print(
            f"step {step + 1}: pp {got:.7f} one process {ref_losses[step]:.7f} diff {abs(got - ref_losses[step]):.1e}"
        )
dist.destroy_process_group()
