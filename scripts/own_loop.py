"""Your own training loop with fsdp-zero: a torchvision VisionTransformer on FakeData, ZeRO-3.

    torchrun --nproc_per_node=2 scripts/own_loop.py [--steps 20] [--run-dir runs/own-loop]

Everything here is what a user migrating from ``deepspeed.initialize(...)`` keeps: their
model, their DataLoader, their loop. fsdp-zero shards the model (`fz.shard`), saves and
resumes sharded checkpoints (`fz.Checkpoints`: run it twice and the second run continues)
and logs per-rank memory to TensorBoard (`fz.MemoryLog`). The same model and data through
``scripts/train.py`` train to the same losses (tests/test_models.py checks it):

    torchrun --nproc_per_node=2 scripts/train.py --config configs/vit_fake.yaml optim.weight_decay=0 \
        optim.warmup_steps=0 optim.min_lr_ratio=1 train.global_batch_size=8 train.micro_batch_size=4
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler
from torchvision import transforms
from torchvision.datasets import FakeData
from torchvision.models import VisionTransformer

import fsdp_zero.api as fz
from fsdp_zero.distributed import DistEnv, exit_process


def fake_images(seed: int, batch_size: int, env: DistEnv) -> DataLoader:
    """1000 fake 32x32 images in 10 classes, each rank its share of a ``batch_size`` global batch."""
    data = FakeData(
        size=1000,
        image_size=(3, 32, 32),
        num_classes=10,
        random_offset=seed,
        transform=transforms.Compose(
            [transforms.ToTensor(), transforms.Normalize((0.5,) * 3, (0.5,) * 3)]
        ),
    )
    sampler = DistributedSampler(data, num_replicas=env.world_size, rank=env.rank, shuffle=False)
    return DataLoader(
        data, batch_size=batch_size // env.world_size, sampler=sampler, drop_last=True
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=8, help="global batch, over all ranks")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--run-dir", default="runs/own-loop")
    args = parser.parse_args()

    with fz.distributed() as env:
        with fz.meta_init():  # no memory for the parameters until each rank materialises its shards
            # 32x32 images in 8x8 patches
            model = VisionTransformer(
                32, 8, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64, num_classes=10
            )
        model = fz.shard(model, env, strategy="full_shard", wrap=["EncoderBlock"], seed=args.seed)
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0, foreach=True
        )

        loader = fake_images(args.seed, args.batch_size, env)
        checkpoints = fz.Checkpoints(f"{args.run_dir}/checkpoints", env, keep_last=2)
        start, _ = checkpoints.resume(model, optimizer)  # (0, {}) on a fresh run
        memory = fz.MemoryLog(args.run_dir, env)
        batches = iter(loader)
        # skip what the checkpoint has seen (1000 images: one pass is enough here)
        for _ in range(start):
            next(batches)
        for step in range(start + 1, args.steps + 1):
            images, labels = next(batches)
            loss = F.cross_entropy(model(images.to(env.device)), labels.to(env.device))
            loss.backward()
            fz.clip_grad_norm_(list(model.parameters()), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            mean = loss.detach().clone()
            dist.all_reduce(mean)  # the global batch's loss, for the log
            mean = mean.item() / env.world_size
            mem = memory.log(step, model, optimizer, loss=mean)
            if env.rank == 0:
                print(
                    f"step {step} loss {mean:.8f} peak rss MiB {mem['memory/cpu_peak_rss_mib']:.0f}",
                    flush=True,
                )
            if step % 10 == 0 or step == args.steps:
                checkpoints.save(step, model, optimizer, {"images_seen": step * args.batch_size})
        memory.close()
        checkpoints.close()


if __name__ == "__main__":
    main()
    # skips a gloo teardown race at interpreter exit (see fsdp_zero.distributed.env.exit_process)
    exit_process(0)
