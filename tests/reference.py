"""Single-process training of the configured model on the whole global batch: the ground truth.

Written independently of fsdp_zero.trainer on purpose (plain torch: one forward over the
global batch, its own loss, torch's own clip_grad_norm_, its own learning-rate schedule; model.freeze
by its own full matches), sharing only the model's construction and initialisation (LoRA's adapters
included) and the data source, so that
parity tests check the sharded loop against it. Precision modes are reproduced by hand
(see `reference_run`); fp16's loss scale is held at its initial value (no overflow in
the tests that compare with it).
"""

from __future__ import annotations

import copy
import math
import re

import torch
import torch.nn.functional as F

from fsdp_zero.build import construct, materializer, real_buffers
from fsdp_zero.config import Config, OptimConfig, Task
from fsdp_zero.data import build_source
from fsdp_zero.lora import make_trainable
from fsdp_zero.precision import resolve
from fsdp_zero.tasks import vocab_size


def reference_lr(cfg: OptimConfig, step: int, total_steps: int) -> float:
    """The learning rate of optimizer step ``step`` (1-based), from docs/configuration.md's words: linear
    warm-up to ``lr`` over ``warmup_steps`` steps, then half a cosine period (or a straight line)
    from ``lr`` towards ``min_lr_ratio * lr``, which the step after the last would reach; or ``lr``
    throughout (constant)."""
    if step <= cfg.warmup_steps:
        return cfg.lr * step / cfg.warmup_steps
    decay_steps = total_steps - cfg.warmup_steps
    done = (step - 1 - cfg.warmup_steps) / decay_steps if decay_steps > 0 else 1.0
    floor = cfg.lr * cfg.min_lr_ratio
    if cfg.schedule.value == "constant":
        return cfg.lr
    if cfg.schedule.value == "linear":
        return cfg.lr - (cfg.lr - floor) * done
    return floor + (cfg.lr - floor) * (math.cos(math.pi * done) + 1) / 2


def reference_run(cfg: Config, initial: dict[str, torch.Tensor] | None = None, device: str = "cpu") -> dict:
    """Trains from the model's initial weights for the seed (or from ``initial`` weights) and returns
    losses, norms and weights (on the CPU, whatever ``device`` trained them)."""
    torch.manual_seed(cfg.train.seed)
    precision = resolve(cfg.precision)
    model = construct(cfg.model)
    if cfg.model.lora.rank:  # the adapters as the build inserts them (their training is what is compared)
        make_trainable(model, cfg.model)
    for name, p in model.named_parameters():  # model.freeze, by its own words: full matches on the names
        if any(re.fullmatch(pattern, name) for pattern in cfg.model.freeze):
            p.requires_grad_(False)
    model = model.to(precision.stored)  # bf16-true: all bf16 (what fsdp_zero.build.shard does)
    materializer(torch.device(device), cfg.model.init, cfg.train.seed, real_buffers(model), [])(model)
    if initial is not None:
        model.load_state_dict(initial)
    initial = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    o = cfg.optim
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        [{"params": [p for p in trained if p.dim() >= 2], "weight_decay": o.weight_decay},
         {"params": [p for p in trained if p.dim() < 2], "weight_decay": 0.0}],
        lr=o.lr, betas=tuple(o.betas), eps=o.eps, foreach=True,
    )
    source = build_source(cfg.data, cfg.train.seed, vocab_size(model))
    gbs = cfg.train.global_batch_size
    # Mixed precision as FSDP2 does it, by hand: forward and backward on a copy whose parameters are
    # cast to the compute dtype (buffers are not), gradients cast back to the stored weights' dtype.
    shadow = model
    if precision.compute != precision.stored:
        shadow = copy.deepcopy(model)
        for p in shadow.parameters():
            p.data = p.data.to(precision.compute)
    scale = 2.0**cfg.precision.initial_scale_power if precision.loss_scaling else 1.0
    losses, norms, lrs = {}, {}, {}
    for step in range(1, cfg.train.steps + 1):
        for group in optimizer.param_groups:
            group["lr"] = reference_lr(o, step, cfg.train.steps)
        if shadow is not model:
            with torch.no_grad():
                for ps, pm in zip(shadow.parameters(), model.parameters()):
                    ps.copy_(pm)
        inputs, targets = (t.to(device) for t in source.batch(range((step - 1) * gbs, step * gbs)))
        out = shadow(inputs)
        logits = getattr(out, "logits", out).float()  # Hugging Face models return an object
        if cfg.model.task is Task.causal_lm:
            logits, targets = logits.flatten(0, 1), targets.flatten()
        loss = F.cross_entropy(logits, targets)
        (loss * scale).backward()
        if shadow is not model:
            for ps, pm in zip(shadow.parameters(), model.parameters()):
                if ps.grad is not None:
                    pm.grad, ps.grad = ps.grad.to(pm.dtype) / scale, None
        norm = torch.nn.utils.clip_grad_norm_(trained, o.grad_clip if o.grad_clip > 0 else float("inf"))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses[step], norms[step], lrs[step] = loss.item(), norm.item(), optimizer.param_groups[0]["lr"]
    final = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    return {"losses": losses, "grad_norms": norms, "lrs": lrs, "initial": initial, "final": final}
