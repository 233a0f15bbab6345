"""The optimizer: AdamW over a built model's trainable parameters (torch's, ZeRO-1's
ZeroRedundancyOptimizer, or torchao's low-bit AdamW: ``optim.state_bits``), its parameter groups and
the bounded step's groups (``optim.step_group_size``).

    optimizer = build_optimizer(model, cfg.optim, device, zero1=False)
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.optim import ZeroRedundancyOptimizer

from fsdp_zero.config.choices import OptimizerImpl
from fsdp_zero.config.schema import OptimConfig
from fsdp_zero.sharding.parallelize import unwrap
from fsdp_zero.torch_private import _init_optim_state, low_bit_adamw

logger = logging.getLogger("fsdp_zero")


def local_numel(p: torch.Tensor) -> int:
    """Elements of ``p`` this rank holds: its shard of an FSDP parameter (a DTensor), else all of them."""
    return (p.to_local() if hasattr(p, "to_local") else p).numel()


def step_groups(params: list[nn.Parameter], size: int) -> list[list[nn.Parameter]]:
    """``params`` cut, in order, into consecutive groups of at most ``size`` local elements (a tensor
    larger than ``size`` is a group of its own); ``size`` 0: one group. (DeepSpeed's ZeRO-3 closes a
    sub-group once it reaches ``sub_group_size``, so its groups may pass it by one tensor; these
    never do.)

    AdamW's update is elementwise and per tensor (each parameter's own step count and bias
    correction), so stepping the groups one after another gives the same bits as one step over all
    of them; foreach AdamW's temporaries (a tensor list as large as the group, e.g. the square roots
    of ``exp_avg_sq``) are then as large as a group instead of the whole shard.
    """
    if size == 0:
        return [params] if params else []
    groups: list[list[nn.Parameter]] = []
    count = 0
    for p in params:
        n = local_numel(p)
        if not groups or count + n > size:
            groups.append([])
            count = 0
        groups[-1].append(p)
        count += n
    return groups


def build_optimizer(
    model: nn.Module,
    cfg: OptimConfig,
    device: torch.device,
    zero1: bool = False,
    whole_groups: bool = False,
) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices and embeddings, and on 1-D parameters (norm gains, biases)
    only with ``optim.decay_1d``.

    With ``zero1``, torch's ZeroRedundancyOptimizer: each rank keeps the AdamW states of
    its own partition of the parameters (whole tensors, balanced by size) and broadcasts
    its updated parameters after the step.

    ``optim.step_group_size`` > 0 with foreach AdamW: each of the two groups is cut into
    `step_groups`, which AdamW steps one after another (the same bits, temporaries bounded by a
    group). Fused and for_loop AdamW make no temporaries larger than one tensor, so they keep the
    two groups (a warning says the setting has no effect where it would have cut them).

    Args:
        model: the built model; its trainable parameters are stepped.
        cfg: the optimizer's settings (``optim.*``).
        device: where the step runs (the host under CPU offload): auto's implementation follows it.
        zero1: ZeRO-1's partitioned states (ZeroRedundancyOptimizer).
        whole_groups: the two groups left whole (offload.states cuts its own step groups, a
            tensor across groups: `fsdp_zero.sharding.offload`).
    """
    impl = optimizer_impl(cfg, device)
    cut = dataclasses.replace(cfg, step_group_size=0) if whole_groups else cfg
    groups = [{"params": ps, "weight_decay": wd} for ps, wd in param_groups(model, cut, impl)]
    kwargs = dict(
        lr=cfg.lr,
        betas=tuple(cfg.betas),
        eps=cfg.eps,
        fused=impl is OptimizerImpl.fused,
        foreach=impl is OptimizerImpl.foreach,
    )
    if zero1:
        return ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW, **kwargs)
    if cfg.state_bits != 32:  # (config.rules refuses zero1 and step groups with it)
        adamw = low_bit_adamw(cfg.state_bits)  # (torchao, on first use)
        return adamw(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)
    return torch.optim.AdamW(groups, **kwargs)


def optimizer_impl(cfg: OptimConfig, device: torch.device) -> OptimizerImpl:
    """``optim.implementation`` resolved for the device the optimizer steps on: auto is fused on CUDA,
    foreach elsewhere."""
    if cfg.implementation is OptimizerImpl.auto:
        return OptimizerImpl.fused if device.type == "cuda" else OptimizerImpl.foreach
    return cfg.implementation


def param_groups(
    model: nn.Module, cfg: OptimConfig, impl: OptimizerImpl
) -> list[tuple[list[nn.Parameter], float]]:
    """AdamW's parameter groups and their weight decay, in order: the trainable matrices and embeddings
    (``optim.weight_decay``), then the 1-D parameters (none; ``optim.weight_decay`` with
    ``optim.decay_1d``), each cut into `step_groups` for foreach.

    With ``optim.decay_1d`` the groups stay two, with equal settings: AdamW's update is per tensor,
    so each parameter is updated as by one group over ``model.parameters()`` (DeepSpeed's optimizer
    from the JSON), and a checkpoint's groups keep their order whichever way it was set."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    # DeepSpeed's JSON optimizer, built over model.parameters(), decays every parameter
    decay_1d = cfg.weight_decay if cfg.decay_1d else 0.0
    size = cfg.step_group_size
    if size and impl is not OptimizerImpl.foreach:
        if any(len(step_groups(ps, size)) > 1 for ps in (decay, no_decay)):
            logger.warning(
                "optim.step_group_size=%d has no effect with %s AdamW (no temporaries larger than "
                "one tensor); it bounds foreach AdamW's",
                size,
                impl.value,
            )
        size = 0
    return [
        (ps, wd)
        for group, wd in ((decay, cfg.weight_decay), (no_decay, decay_1d))
        for ps in step_groups(group, size)
    ]


class OptimizerState:
    """The optimizer's checkpoint part (a `Stateful`, `fsdp_zero.checkpoint.parts`): AdamW's states
    keyed by parameter FQN through torch's state-dict API (sharded DTensors under FSDP)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optimizer)["state"]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        groups = get_optimizer_state_dict(self.model, self.optimizer)["param_groups"]
        set_optimizer_state_dict(
            self.model, self.optimizer, {"state": state, "param_groups": groups}
        )


class Zero1State:
    """ZeRO-1's partition as the optimizer's checkpoint part. torch's state-dict API does not cover
    ZeroRedundancyOptimizer: each rank contributes the AdamW states of its own partition, under the
    same FQN keys, so the checkpoint holds every parameter's state once, in full, like a DDP one
    (and loads at any world size)."""

    def __init__(self, model: nn.Module, optimizer: ZeroRedundancyOptimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        local = self.optimizer.optim  # this rank's AdamW over its partition
        if not local.state:
            _init_optim_state(local)  # lazily created states must exist to be loaded into
        names = {id(p): fqn for fqn, p in unwrap(self.model).named_parameters()}
        return {names[id(p)]: dict(st) for p, st in local.state.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing left to do: `state_dict`'s values are the live states, loaded in place by DCP."""


def optimizer_state(
    model: nn.Module, optimizer: torch.optim.Optimizer
) -> OptimizerState | Zero1State:
    """The checkpoint part of the optimizer `build_optimizer` made for ``model``: ZeRO-1's partition
    (`Zero1State`) or torch's state-dict API (`OptimizerState`)."""
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        return Zero1State(model, optimizer)
    part = getattr(optimizer, "state_part", None)  # offload.states' (`fsdp_zero.sharding.offload`)
    return part(unwrap(model)) if part is not None else OptimizerState(model, optimizer)
