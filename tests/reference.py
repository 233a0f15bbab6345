"""Single-process training of the configured model on the whole global batch: the ground truth.

Written independently of fsdp_zero.training.trainer on purpose (plain torch: one forward over the
global batch, its own loss, torch's own clip_grad_norm_, its own learning-rate schedule; model.freeze
by its own full matches; LoRA's adapters built, initialised and frozen around by hand from
docs/lora.md's words, without fsdp_zero.model.lora), sharing only the model's construction and the base
model's initialisation and the data source, so that parity tests check the sharded loop (and the
product's LoRA module and adapter init) against it. Precision modes are reproduced by hand
(see `reference_run`); fp16's loss scale is held at its initial value (no overflow in
the tests that compare with it).
"""

from __future__ import annotations

import copy
import math
import re

import torch
import torch.nn.functional as F
from torch import nn

from fsdp_zero.config.choices import Task
from fsdp_zero.config.schema import Config, LoRAConfig, OptimConfig
from fsdp_zero.data.batches import build_source
from fsdp_zero.model import init as init_lib
from fsdp_zero.model.construct import construct, real_buffers
from fsdp_zero.model.tasks import vocab_size
from fsdp_zero.sharding.build import materializer
from fsdp_zero.sharding.precision import resolve_precision


class _Matrix(nn.Module):
    """One adapter matrix, held as ``weight`` so that its state-dict name ends in ``.weight`` (PEFT's)."""

    def __init__(self, rows: int, cols: int, like: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, cols, device=like.device, dtype=like.dtype))


class Adapted(nn.Module):
    """docs/lora.md's adapted Linear X, by hand: ``W x + b + (alpha / rank) * B(A(dropout(x)))``.

    It holds the replaced Linear's own ``weight`` and ``bias`` Parameters (so the base keys and tied
    weights are unchanged) and the adapters ``lora_A.weight`` (rank x in) and ``lora_B.weight``
    (out x rank): the state-dict names the product's checkpoints and exports use.
    """

    def __init__(self, linear: nn.Linear, rank: int, alpha: float, dropout: float) -> None:
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.lora_A = _Matrix(rank, linear.in_features, linear.weight)
        self.lora_B = _Matrix(linear.out_features, rank, linear.weight)
        self.dropout, self.scaling = dropout, alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.dropout(x, self.dropout, training=True) if self.training and self.dropout > 0 else x
        return (
            F.linear(x, self.weight, self.bias)
            + self.scaling * (h @ self.lora_A.weight.T) @ self.lora_B.weight.T
        )


def lora_targets(model: nn.Module, cfg: LoRAConfig) -> list[str]:
    """The FQNs of the plain ``nn.Linear`` modules that ``model.lora.targets`` names, by the rule of its
    documentation: an entry equal to a module's last name component, or a regex matching its full name."""
    linears = [n for n, m in model.named_modules() if type(m) is nn.Linear]
    hits: set[str] = set()
    for target in cfg.targets:
        found = {n for n in linears if n.rpartition(".")[2] == target or re.fullmatch(target, n)}
        # the build refuses it
        assert found, f"model.lora.targets: {target!r} names no nn.Linear of {linears}"
        hits |= found
    return sorted(hits)


def add_adapters(model: nn.Module, cfg: LoRAConfig, seed: int) -> None:
    """Replaces each targeted Linear of the materialised ``model`` by an `Adapted` one and initialises its
    adapters as docs/lora.md says: A ~ U(-1/sqrt(in), 1/sqrt(in)) (PEFT's kaiming_uniform with a = sqrt(5)),
    drawn by the generic world-size-invariant primitive from the seed and A's name; B zero."""
    for fqn in lora_targets(model, cfg):
        parent, _, child = fqn.rpartition(".")
        owner = model.get_submodule(parent)
        adapted = Adapted(getattr(owner, child), cfg.rank, cfg.alpha, cfg.dropout)
        init_lib.uniform_(
            adapted.lora_A.weight,
            bound=1 / math.sqrt(adapted.in_features),
            seed=seed,
            name=f"{fqn}.lora_A.weight",
        )
        with torch.no_grad():
            adapted.lora_B.weight.zero_()
        setattr(owner, child, adapted)


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


def _balance_loss(model: nn.Module, router_logits: tuple, sequences: int) -> torch.Tensor:
    """A mixture's load-balancing loss times its weight, by docs/parallelism.md's words: per layer
    and sequence, E x sum_e (share of the sequence's top-k slots routed to e) x (mean softmax or
    normalised sigmoid score of e), averaged over layers and sequences."""
    args = getattr(model, "args", None)
    if args is not None:  # the built-in model
        e, k, coef, score = (
            args.n_experts,
            args.experts_top_k,
            args.aux_loss_coef,
            args.router_score,
        )
    else:
        c = model.config
        e = getattr(c, "num_experts", None) or c.num_local_experts
        k, coef, score = c.num_experts_per_tok, c.router_aux_loss_coef, "softmax"
    per_layer = []
    for logits in router_logits:
        logits = logits.float().view(sequences, -1, e)
        tokens = logits.shape[1]
        if score == "softmax":
            scores = torch.softmax(logits, -1)
        else:
            scores = torch.sigmoid(logits) / torch.sigmoid(logits).sum(-1, keepdim=True)
        chosen = logits.topk(k, -1).indices  # (sequences, tokens, k)
        share = torch.zeros(sequences, e)
        for b in range(sequences):
            for i in chosen[b].flatten().tolist():
                share[b, i] += 1 / (tokens * k)
        per_layer.append((e * (share * scores.mean(1)).sum(-1)).mean())
    return coef * torch.stack(per_layer).mean()


def reference_run(
    cfg: Config, initial: dict[str, torch.Tensor] | None = None, device: str = "cpu"
) -> dict:
    """Trains from the model's initial weights for the seed (or from ``initial`` weights) and returns
    losses, norms and weights (on the CPU, whatever ``device`` trained them)."""
    torch.manual_seed(cfg.train.seed)
    precision = resolve_precision(cfg.precision)
    model = construct(cfg.model)
    # bf16-true: all bf16 (what fsdp_zero.sharding.build.shard does)
    model = model.to(precision.stored)
    # The base model's weights, initialised as the build does: the built-in model's init_weights and
    # init_standard draw per name, so the adapters' presence in the build changes none of them. No LoRA
    # module exists yet here, so the build's own adapter init (in materializer) finds nothing to do.
    materializer(torch.device(device), cfg.model.init, cfg.train.seed, real_buffers(model), [])(
        model
    )
    lora = cfg.model.lora
    # the base model's (tied: every name)
    names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    full = lambda patterns, name: any(re.fullmatch(p, name) for p in patterns)  # noqa: E731
    # model.freeze and model.lora.train by their own words: full matches on the names; with LoRA every base
    # parameter is frozen unless model.lora.train names it (and model.freeze does not).
    frozen = {
        n for n in names if full(cfg.model.freeze, n) or (lora.rank and not full(lora.train, n))
    }
    if lora.rank:
        add_adapters(model, lora, cfg.train.seed)
    for name, p in model.named_parameters(remove_duplicate=False):
        if name in frozen:
            p.requires_grad_(False)
    if initial is not None:
        model.load_state_dict(initial)
    initial = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    o = cfg.optim
    trained = [p for p in model.parameters() if p.requires_grad]
    # the 1-D parameters: decayed only with optim.decay_1d (DeepSpeed's JSON optimizer decays every one)
    decay_1d = o.weight_decay if o.decay_1d else 0.0
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for p in trained if p.dim() >= 2], "weight_decay": o.weight_decay},
            {"params": [p for p in trained if p.dim() < 2], "weight_decay": decay_1d},
        ],
        lr=o.lr,
        betas=tuple(o.betas),
        eps=o.eps,
        foreach=True,
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
        if getattr(out, "router_logits", None):
            loss = loss + _balance_loss(model, out.router_logits, inputs.shape[0])
        (loss * scale).backward()
        if shadow is not model:
            for ps, pm in zip(shadow.parameters(), model.parameters()):
                if ps.grad is not None:
                    pm.grad, ps.grad = ps.grad.to(pm.dtype) / scale, None
        norm = torch.nn.utils.clip_grad_norm_(
            trained, o.grad_clip if o.grad_clip > 0 else float("inf")
        )
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses[step], norms[step], lrs[step] = (
            loss.item(),
            norm.item(),
            optimizer.param_groups[0]["lr"],
        )
    final = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    return {"losses": losses, "grad_norms": norms, "lrs": lrs, "initial": initial, "final": final}
