"""Single-process training of the built-in model on the whole global batch: the ground truth.

Written independently of fsdp_zero.trainer on purpose (plain torch: one forward over the
global batch, torch's own clip_grad_norm_), sharing only the model, the data source and
the learning-rate formula, so that parity tests check the sharded loop against it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fsdp_zero.config import Config
from fsdp_zero.data import build_source
from fsdp_zero.model import build_model
from fsdp_zero.trainer import lr_factor, transformer_args


def reference_run(cfg: Config, initial: dict[str, torch.Tensor] | None = None) -> dict:
    """Trains from ``init_weights`` (or from ``initial`` weights) and returns losses, norms and weights."""
    torch.manual_seed(cfg.train.seed)
    args = transformer_args(cfg.model)
    model = build_model(args, device="cpu")
    model.init_weights(cfg.train.seed)
    if initial is not None:
        model.load_state_dict(initial)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    o = cfg.optim
    optimizer = torch.optim.AdamW(
        [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": o.weight_decay},
         {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}],
        lr=o.lr, betas=tuple(o.betas), eps=o.eps, foreach=True,
    )
    source = build_source(cfg.data, args.vocab_size, cfg.train.seed)
    gbs = cfg.train.global_batch_size
    losses, norms = {}, {}
    for step in range(1, cfg.train.steps + 1):
        for group in optimizer.param_groups:
            group["lr"] = o.lr * lr_factor(step - 1, o, cfg.train.steps)
        tokens = source.samples(range((step - 1) * gbs, step * gbs))
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip if o.grad_clip > 0 else float("inf"))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses[step], norms[step] = loss.item(), norm.item()
    final = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"losses": losses, "grad_norms": norms, "initial": initial, "final": final}
