"""Real DeepSpeed runs whose checkpoints tests/test_ds_import.py imports: ``make deepspeed-runs`` reruns them.

    PYTHONPATH=.deepspeed DS_ACCELERATOR=cpu torchrun --standalone --nproc_per_node=2 \\
        tests/deepspeed_runs/make.py [CASE ...]   # and again with 3 ranks: the cases of each world size

DeepSpeed (CPU accelerator, gloo, no compiled ops) trains the built-in transformer (a 7,000-parameter
gpt_nano; ZeRO-1's with its output layer tied to the embedding) for ``STEPS`` AdamW steps at 2 ranks under
ZeRO-1 (fp32 and bf16), -2 and -3, and under ZeRO-3 at 3 ranks (partitions padded); and, as a DeepSpeed user
runs it, a GPT of the user's own (tests/user_gpt.py: LayerNorms and biases) under ZeRO-3 at 2 ranks
(``user-gpt``). Each case has another of DeepSpeed's schedules and its own ds_config.json; its optimizer is
built from the JSON (torch's AdamW): the built-in model's over fsdp-zero's two parameter groups (decay on
matrices and embeddings only: ``optim.decay_1d=false``, recorded with its overrides), the user's GPT's over
``model.parameters()`` (one group, every parameter decayed, as DeepSpeed, Hugging Face's Trainer and
Accelerate build it: what ``--deepspeed`` assumes). Each trains on fsdp-zero's data order (the synthetic
source: the global batch of step s is samples [s G, (s+1) G), rank r's share its r-th slice, cut into
micro-batches). It saves with ``engine.save_checkpoint`` after step
``k`` and goes on to the end. Each case's folder keeps what DeepSpeed wrote (``latest``,
``global_stepK/``; DeepSpeed's copies of its zero_to_*.py scripts are deleted), the ds_config.json it ran
with, ``run.json`` (the loss and learning rate of every step, as DeepSpeed computed them, and the
versions), ``saved.safetensors`` (each parameter's fp32 weight and AdamW moments at the save, flat, as
DeepSpeed's own ``ds_to_universal`` gathers them: ``NAME/fp32``, ``NAME/exp_avg``, ``NAME/exp_avg_sq``)
and ``final.safetensors`` (the fp32 weights after the last step). ZeRO-3's universal form is kept,
as ``zero3-universal/``.

Never imported by the suite: only this script needs DeepSpeed; the tests read its files.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from safetensors.torch import save_file

from fsdp_zero.config.loader import load_config
from fsdp_zero.data.batches import build_source
from fsdp_zero.model.construct import construct, real_buffers
from fsdp_zero.model.tasks import causal_lm, vocab_size
from fsdp_zero.sharding.build import materializer

HERE = Path(__file__).resolve().parent
# The model and data both sides train (tests/test_ds_import.py passes the same overrides to ours).
MODEL = (
    "model.preset=gpt_nano",
    "model.dim=16",
    "model.n_heads=2",
    "model.vocab_size=64",
    "model.ffn_hidden_dim=32",
    "data.seq_len=16",
    "train.seed=0",
)
# ZeRO-1's model ties its output layer to the embedding (DeepSpeed's shared_params)
TIED = ("model.tie_embeddings=true",)
# DeepSpeed given fsdp-zero's two groups: ours without decay on the 1-D parameters, which --deepspeed
# (an optimizer section: optim.decay_1d=true) cannot read in the JSON
TWO_GROUPS = ("optim.decay_1d=false",)
# A DeepSpeed user's own GPT (LayerNorms, biases), its optimizer over model.parameters()
USER_GPT = (
    "model.target=tests.user_gpt:GPT",
    "model.task=causal_lm",
    "model.kwargs.vocab=64",
    "model.kwargs.seq_len=16",
    "data.seq_len=16",
    "train.seed=0",
)
STEPS = 8
# WarmupDecayLR's linear warm-up from warmup_min_lr, saved inside it (zero3's and the user's GPT's)
_WARMUP_DECAY = {
    "type": "WarmupDecayLR",
    "params": {
        "warmup_num_steps": 4,
        "warmup_type": "linear",
        "warmup_min_lr": 1e-4,
        "warmup_max_lr": 3e-3,
        "total_num_steps": STEPS,
    },
}
_OPTIMIZER = {
    "type": "AdamW",
    "params": {
        "lr": 3e-3,
        "betas": [0.9, 0.95],
        "eps": 1e-8,
        "weight_decay": 0.1,
        "torch_adam": True,
    },
}
# case -> (ranks, ZeRO stage, samples a step, the step after which it saves, its scheduler)
CASES = {
    "zero1": (
        2,
        1,
        8,
        2,
        {"type": "WarmupLR", "params": {"warmup_num_steps": 3, "warmup_max_lr": 3e-3}},
    ),
    "zero2": (
        2,
        2,
        8,
        4,
        {
            "type": "WarmupCosineLR",
            "params": {
                "warmup_num_steps": 2,
                "warmup_min_ratio": 0.1,
                "cos_min_ratio": 0.1,
                "total_num_steps": STEPS,
            },
        },
    ),
    # saved inside the warm-up
    "zero3": (
        2,
        3,
        8,
        3,
        _WARMUP_DECAY,
    ),
    # bf16: ZeRO-1 is DeepSpeed's BF16_Optimizer then (its own files, bf16_zero_pp_rank_*), fp32 masters
    "zero1-bf16": (
        2,
        1,
        8,
        2,
        {"type": "WarmupLR", "params": {"warmup_num_steps": 3, "warmup_max_lr": 3e-3}},
    ),
    # 3 ranks: ZeRO-3's partitions padded (256 / 3 elements of a 16 x 16 matrix a rank)
    "zero3-n3": (
        3,
        3,
        24,
        2,
        {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 2, "total_num_steps": STEPS}},
    ),
    # the user's GPT, its LayerNorms and biases decayed by weight_decay 0.1 too; zero3's schedule, saved
    # inside the warm-up
    "user-gpt": (
        2,
        3,
        8,
        3,
        _WARMUP_DECAY,
    ),
}


def ds_config(name: str, stage: int, batch: int, scheduler: dict) -> dict:
    """The case's ds_config.json: ``batch`` samples a step, micro-batches of 2 (gradient accumulation
    derived from the world size), clipping at 0.5, fp32 (bf16 for a case named so).

    The user's GPT's AdamW has eps 1e-5: its attention's key bias (qkv.bias[dim:2 dim]) has a gradient of
    zero in exact arithmetic (softmax ignores a shift shared by every key), so what it gets is rounding
    (about 1e-10, different in every implementation and world size), which eps 1e-8 would turn into
    steps of about lr / 300, each run its own (a continuation here ends 6.8e-5 off DeepSpeed's there);
    with 1e-5, about lr / 1e5."""
    optimizer = _OPTIMIZER
    if name == "user-gpt":
        optimizer = {**optimizer, "params": {**optimizer["params"], "eps": 1e-5}}
    return {
        "train_batch_size": batch,
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 0.5,
        "optimizer": optimizer,
        "scheduler": scheduler,
        "zero_optimization": {"stage": stage},
        "steps_per_print": 1000,
        **({"bf16": {"enabled": True}} if name.endswith("-bf16") else {}),
    }


def _model(cfg) -> torch.nn.Module:
    """The case's model (the built-in one, or the user's GPT) with its initial weights for the seed, as
    fsdp-zero initialises it."""
    model = construct(cfg.model)
    materializer(torch.device("cpu"), cfg.model.init, cfg.train.seed, real_buffers(model), [])(
        model
    )
    return model


def run_case(name: str, stage: int, batch: int, save_after: int, scheduler: dict) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    out = HERE / name
    config = ds_config(name, stage, batch, scheduler)
    if name == "user-gpt":
        overrides = list(USER_GPT)
    else:
        overrides = [*MODEL, *(TIED if name == "zero1" else ()), *TWO_GROUPS]
    cfg = load_config(None, overrides)
    model = _model(cfg)
    if name == "user-gpt":
        groups = model.parameters()  # one group: DeepSpeed decays every parameter
    else:
        params = [p for p in model.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2]},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=groups, config=config)
    source = build_source(cfg.data, cfg.train.seed, vocab_size(model))
    batch, micro = config["train_batch_size"], config["train_micro_batch_size_per_gpu"]
    per_rank = batch // world
    losses, lrs = [], []
    for step in range(STEPS):
        lrs.append(engine.get_lr()[0])
        total = torch.zeros(())
        for start in range(
            step * batch + rank * per_rank, step * batch + (rank + 1) * per_rank, micro
        ):
            loss, _ = causal_lm(engine, source.batch(range(start, start + micro)))
            engine.backward(loss)
            engine.step()
            total += loss.detach()
        dist.all_reduce(total)
        losses.append(total.item() / (per_rank // micro) / world)
        if step + 1 == save_after:
            engine.save_checkpoint(str(out))
    # the weights after the last step, gathered (ZeRO-3 holds each rank's partition only)
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), enabled=stage == 3):
        final = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    if rank == 0:
        for script in (
            "zero_to_fp32.py",
            "zero_to_torch.py",
        ):  # DeepSpeed's code: not ours to commit
            (out / script).unlink(missing_ok=True)
        (out / "ds_config.json").write_text(json.dumps(config, indent=1) + "\n")
        save_file(final, out / "final.safetensors")
        record = {
            "overrides": overrides,
            "world_size": world,
            "saved_after": save_after,
            "losses": losses,
            "lrs": lrs,
            "versions": {"deepspeed": deepspeed.__version__, "torch": torch.__version__},
        }
        (out / "run.json").write_text(json.dumps(record, indent=1) + "\n")
    dist.barrier()


def _universal(name: str) -> None:
    """DeepSpeed's ``ds_to_universal`` of the case's checkpoint: kept whole for ZeRO-3
    (``zero3-universal/``); for every case its parameters go into ``saved.safetensors``."""
    tag = (HERE / name / "latest").read_text().strip()
    universal = HERE / f"{name}-universal"
    shutil.rmtree(universal, ignore_errors=True)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "deepspeed.checkpoint.ds_to_universal",
            "--input_folder",
            str(HERE / name / tag),
            "--output_folder",
            str(universal / f"{tag}_universal"),
            "--inject_missing_state",  # what a plain (non-Megatron) run lacks for ZeRO-1/2
        ],
        check=True,
        env={**os.environ, "WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0"},
    )
    (universal / "latest_universal").write_text(f"{tag}_universal")
    saved = {}
    for folder in sorted((universal / f"{tag}_universal" / "zero").iterdir()):
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            if (folder / f"{key}.pt").is_file():
                loaded = torch.load(
                    folder / f"{key}.pt"
                )  # ZeRO-3's: the tensor; others: {"param": ...}
                loaded = loaded["param"] if isinstance(loaded, dict) else loaded
                saved[f"{folder.name}/{key}"] = loaded.flatten()
    save_file(saved, HERE / name / "saved.safetensors")
    if name != "zero3":
        shutil.rmtree(universal)


def main() -> None:
    """Runs the cases for this world size (``make deepspeed-runs`` launches 2, then 3 ranks)."""
    deepspeed.init_distributed(dist_backend="gloo")
    named = sys.argv[1:] or list(CASES)  # some cases only: make.py CASE ...
    cases = {k: v for k, v in CASES.items() if v[0] == dist.get_world_size() and k in named}
    for name, (_, stage, batch, save_after, scheduler) in cases.items():
        if dist.get_rank() == 0:
            shutil.rmtree(HERE / name, ignore_errors=True)
        dist.barrier()
        run_case(name, stage, batch, save_after, scheduler)
    if dist.get_rank() == 0:
        for name in cases:
            _universal(name)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
