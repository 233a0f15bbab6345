"""Expert parallelism (``parallel.ep_size``; torchtitan's ``ExpertParallel`` and
``AllToAllTokenDispatcher``, DeepSpeed-MoE's layout).

A mixture's routed experts (the model's ``ep_plan``, `fsdp_zero.model.contract`: modules holding
the experts' weights stacked on dim 0, (tokens, experts, weights) -> out) are divided over the ranks
of an expert-parallel group: rank r holds experts [r E / ep, (r + 1) E / ep). Their weights become
DTensors ``Shard(0)`` on the mesh's ``ep`` dimension, and FSDP shards each unit of experts over the
data-parallel ranks ep leaves (`fsdp_zero.distributed.Topology.expert_mesh`: torchtitan's
``dp_shard_mod_ep``; FSDP2's 2-D FSDP + EP), while every other parameter is sharded over all the
data-parallel ranks: a rank gathers only its group's share of the experts, never another group's.

Each experts module's forward is replaced by the dispatch (`ExpertParallel.dispatch`):

1. this rank's (token, slot) pairs sorted by expert (stable: token order within an expert), and
   the count for every expert exchanged (one small all-to-all), so each rank knows what it
   receives;
2. the tokens sent to the ranks that hold their experts (``all_to_all_single``, uneven splits);
3. the received tokens run through the module's own forward with its local slice of the weights,
   each as a slot of weight 1 of its local expert;
4. the outputs sent back the same way, weighted by the router's weights and summed into each token
   in the order of the experts (as the module's own forward sums them).

A rank's result is thus independent of the EP degree (the same sorted order, the same sums). The
backward of each exchange is the reverse exchange. Each expert's gradient sums the tokens of
every rank of the group; FSDP then reduces it over the ranks ep leaves and divides by all the
data-parallel ranks (``set_gradient_divide_factor``), as it does the others.

Bytes: a rank's dispatch sends its (token, slot) pairs routed to experts on other ranks, S of
them, and its combine sends back the R pairs it received from other ranks, ``dim`` values of b
bytes each; their backwards send the same counts the other way. So a forward and backward move
2 (S + R) dim b bytes a rank, and a checkpointed block's recompute (S + R) dim b more
(`DispatchCount`, `dispatch_formula`). When the router balances, S and R are each about
tokens x top-k x (ep - 1) / ep.
"""

from __future__ import annotations

import contextlib
import fnmatch
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard

from fsdp_zero.model.contract import model_facts
from fsdp_zero.torch_private import in_backward, is_fake, local_parameters


def expert_fqns(model: nn.Module) -> list[str]:
    """The names of ``model``'s routed-experts modules (its ``ep_plan``'s matches), in model
    order."""
    patterns = model_facts(model).ep_plan
    return [
        name
        for name, _ in model.named_modules()
        if name and any(fnmatch.fnmatchcase(name, p) for p in patterns)
    ]


def expert_params(model: nn.Module) -> int:
    """The parameters of ``model``'s routed experts (all of them, whichever rank holds them)."""
    return sum(
        math.prod(p.shape) for f in expert_fqns(model) for p in model.get_submodule(f).parameters()
    )


@dataclass
class DispatchCount:
    """What this rank's exchanges sent since the last `take`, counted on the host from the splits:
    ``sent``, the bytes to other ranks (each pair's ``dim`` values; dispatch and combine, forward,
    backward and recompute); and from the forwards only (not a recompute) ``routed``, the bytes of
    the (token, slot) pairs it sent to and received from other ranks, by experts module (what
    `dispatch_formula` reads)."""

    sent: int = 0
    routed: dict[str, int] = field(default_factory=dict)

    def take(self) -> tuple[int, dict[str, int]]:
        out = (self.sent, self.routed)
        self.sent, self.routed = 0, {}
        return out


def balanced_bytes(
    module: nn.Module, *, tokens: int, top_k: int, size: int, itemsize: int, recomputed: bool
) -> float:
    """The bytes one experts module's exchanges send a micro-batch on a rank when the router
    balances: S = R = tokens x top_k x (size - 1) / size pairs of ``dim`` values each way,
    `dispatch_formula`'s (2 or 3) x (S + R) x dim x itemsize.

    Args:
        module: the experts module (``dim``: its weights' last dimension).
        tokens: a micro-batch's tokens on the rank.
        top_k: experts a token.
        size: the expert-parallel ranks.
        itemsize: the compute dtype's bytes.
        recomputed: its block is recomputed in backward (the exchanges run again).
    """
    dim = next(module.parameters()).shape[-1]
    pairs = tokens * top_k * (size - 1) / size
    return (3 if recomputed else 2) * 2 * pairs * dim * itemsize


def active_params(model: nn.Module) -> int:
    """The parameters a token computes with: all of ``model``'s, less the routed experts it does
    not pick (a mixture's: (E - k) / E of the experts' parameters)."""
    total = sum(p.numel() for p in model.parameters())
    moe = model_facts(model).moe
    if moe is None:
        return total
    experts, k = moe["num_experts"], moe["num_experts_per_tok"]
    return total - round(expert_params(model) * (experts - k) / experts)


def dispatch_formula(routed: dict[str, int], recomputed: set[str]) -> int:
    """The bytes a rank's exchanges send for the routing ``routed`` (`DispatchCount.routed`: by
    experts module, the bytes of the pairs it sent and received in forward): twice each (forward
    and backward), once more where the module's block is ``recomputed``."""
    return sum((3 if fqn in recomputed else 2) * n for fqn, n in routed.items())


class _Exchange(torch.autograd.Function):
    """``x``'s rows, ``send[j]`` of them to rank j, and ``receive[j]`` from each back; the backward
    is the reverse exchange."""

    @staticmethod
    def forward(ctx, x, send, receive, group, count):  # noqa: ANN001, ANN205
        ctx.send, ctx.receive, ctx.group, ctx.count = send, receive, group, count
        return _exchange(x, send, receive, group, count)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        back = _exchange(grad, ctx.receive, ctx.send, ctx.group, ctx.count)
        return back, None, None, None, None


def _exchange(
    x: torch.Tensor,
    send: list[int],
    receive: list[int],
    group: dist.ProcessGroup,
    count: DispatchCount,
) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(receive), *x.shape[1:]))
    row = math.prod(x.shape[1:]) * x.element_size()
    me = dist.get_rank(group)
    count.sent += sum(n for j, n in enumerate(send) if j != me) * row
    dist.all_to_all_single(out, x, receive, send, group=group)
    return out


@dataclass
class ExpertParallel:
    """Expert parallelism over this rank's group (what the lever made): the experts modules, their
    group and this rank's place in it, the dispatch's count, and the factor their gradients are
    divided by (every data-parallel rank)."""

    fqns: list[str]
    group: dist.ProcessGroup
    size: int
    rank: int
    experts: int  # routed experts a module holds in all
    divide: int  # the data-parallel ranks FSDP averages the other gradients over
    mesh: DeviceMesh  # what FSDP shards the experts over (`Topology.expert_mesh`)
    count: DispatchCount = field(default_factory=DispatchCount)
    modules: list[nn.Module] = field(default_factory=list)  # the experts modules (FSDP units)
    params: int = 0  # the routed experts' parameters, all of them

    def where(self) -> str:
        """The model-state formula's experts term, in words (its dense term is the same / N)."""
        shard = self.mesh.shape[-1]  # (hybrid_shard: within a replica)
        return (
            f"; of them the {self.params:,} experts' over ep {self.size} x the {shard} ranks ep "
            f"leaves (/ {self.size * shard}), the others over all {self.size * shard}"
        )

    @property
    def local(self) -> int:
        """Experts this rank holds a module."""
        return self.experts // self.size

    def mesh_for(self, fqn: str) -> DeviceMesh | None:
        """The mesh FSDP shards unit ``fqn`` over (None: the run's, `Role.SHARD`'s)."""
        return self.mesh if fqn in self.fqns else None

    def divided(self, units: list[FSDPModule]) -> None:
        """The experts units' gradients divided by every data-parallel rank, as the others' are
        (FSDP's default divides by the ranks of the unit's own mesh, ep fewer)."""
        for unit in units:
            if any(unit is m for m in self.modules):
                unit.set_gradient_divide_factor(float(self.divide))
                # a sum, then scaled (gloo has no PREMUL_SUM); not where the experts' shard group
                # is one rank: FSDP2 (torch 2.15) then divides its copy and again after it
                if self.mesh.shape[-1] > 1:
                    unit.set_force_sum_reduction_for_comms(True)

    def note(self) -> str:
        return (
            f"expert parallelism: ep {self.size}, {self.local} of {self.experts} experts a layer "
            f"on this rank (experts {self.rank * self.local}-{(self.rank + 1) * self.local - 1}), "
            f"sharded over the {self.mesh.size()} data-parallel ranks ep leaves; tokens sent to "
            "them and back by all-to-all"
        )

    def dispatch(
        self,
        fqn: str,
        module: nn.Module,
        x: torch.Tensor,
        experts: torch.Tensor,
        weights: torch.Tensor,
    ) -> torch.Tensor:
        """The experts module's forward under expert parallelism (the module docstring's steps).

        Args:
            fqn: the module's name (its routing counted under it).
            module: the experts module, this rank's slice of the experts.
            x: (tokens, dim) this rank's tokens.
            experts: (tokens, k) each token's experts (global indices; >= the experts: none).
            weights: (tokens, k) the router's weights.

        Returns:
            (tokens, dim): each token's experts' outputs, weighted and summed.
        """
        k, n = experts.shape[1], self.experts
        if is_fake(x):  # the planner's simulation: shapes only, routing balanced
            return self._balanced(module, x, weights)
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)  # slots by expert, token order within one
        per_expert = torch.bincount(flat, minlength=n + 1)[:n]  # (dropped slots: index n, last)
        # 1. each rank's count for each of this rank's experts; the host reads both (two syncs)
        counts = torch.empty_like(per_expert)
        dist.all_to_all_single(counts, per_expert, group=self.group)
        mine = per_expert.tolist()
        send = [sum(mine[j * self.local : (j + 1) * self.local]) for j in range(self.size)]
        counts = counts.view(self.size, self.local)  # [j, e]: rank j's tokens for local expert e
        receive = counts.sum(1).tolist()
        order = order[: sum(send)]
        if not in_backward():  # (a recompute routes the same pairs again)
            remote = sum(s + r for j, (s, r) in enumerate(zip(send, receive)) if j != self.rank)
            row = x.shape[-1] * x.element_size()
            self.count.routed[fqn] = self.count.routed.get(fqn, 0) + remote * row
        # 2. the tokens to their experts' ranks
        tokens = order // k
        got = _Exchange.apply(x[tokens], send, receive, self.group, self.count)
        # 3. this rank's experts, each received token a slot of weight 1 of its local expert
        local = torch.arange(self.local, device=x.device).repeat(self.size)
        local = local.repeat_interleave(counts.reshape(-1)).unsqueeze(1)
        with local_parameters(module) as params, _local_count(module, self.experts, self.local):
            out = type(module).forward(module, got, local, torch.ones_like(local, dtype=x.dtype))
            if sum(receive) == 0:
                # no token: the weights still get a (0) gradient, which FSDP reduces with the
                # other ranks', and the empty exchange its backward, which its peers' wait for
                out = out + got.sum() * 0 + sum(p.reshape(-1)[:1].sum() * 0 for p in params)
        # 4. back to the tokens' ranks, weighted, summed in the order of the experts
        back = _Exchange.apply(out, receive, send, self.group, self.count)
        weighted = back * weights.reshape(-1)[order, None]
        return torch.zeros_like(x).index_add_(0, tokens, weighted.to(x.dtype))

    def _balanced(self, module: nn.Module, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """`dispatch` on fake tensors (`simulated_routing`): each rank's pairs spread evenly over
        the group's ranks and their experts, what a balanced router sends."""
        k = weights.shape[1]
        rows = x.repeat_interleave(k, 0)
        share = [len(rows) // self.size] * self.size
        share[-1] += len(rows) - sum(share)
        got = _Exchange.apply(rows, share, share, self.group, self.count)
        out = balanced_compute(module, got, self.local)
        back = _Exchange.apply(out, share, share, self.group, self.count)
        return _weighted(back, weights, x.dtype)


def _weighted(out: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Each token's k rows of ``out`` (in slot order) weighted by ``weights`` (tokens, k) and
    summed: the planner's stand-ins' combine."""
    return (out.view(*weights.shape, -1) * weights.unsqueeze(-1)).sum(1).to(dtype)


# the attributes an experts module counts its experts in (Hugging Face's, the built-in's)
_COUNTS = ("num_experts", "n_experts")


@contextlib.contextmanager
def _local_count(module: nn.Module, experts: int, local: int) -> Iterator[None]:
    """While open, ``module``'s count of its experts (`_COUNTS`) reads ``local``: it computes as a
    module of this rank's experts (Hugging Face's grouped_mm forward bins tokens by it)."""
    names = [n for n in _COUNTS if getattr(module, n, None) == experts]
    try:
        for n in names:
            setattr(module, n, local)
        yield
    finally:
        for n in names:
            setattr(module, n, experts)


def balanced_compute(module: nn.Module, rows: torch.Tensor, experts: int) -> torch.Tensor:
    """What an experts module computes for ``rows`` (its tokens, gathered) when each of its
    ``experts`` takes an equal share, shapes only (the planner's stand-in: its own forward routes
    by the data). A SwiGLU expert of stacked weights: the last parameter the down projection, the
    others the up (two, or one holding both halves)."""
    h = rows.shape[-1]
    n = -(-rows.shape[0] // experts)
    padded = torch.cat([rows, rows.new_zeros(n * experts - rows.shape[0], h)])
    group = padded.view(experts, n, h)
    with local_parameters(module) as params:
        ups = [torch.bmm(group, p.transpose(1, 2)) for p in params[:-1]]
        first, second = ups if len(ups) == 2 else ups[0].chunk(2, dim=-1)
        out = torch.bmm(F.silu(first) * second, params[-1].transpose(1, 2))
    return out.reshape(-1, h)[: rows.shape[0]]


def simulated_routing(model: nn.Module) -> None:
    """The planner's simulation (fake tensors: no data to route by): each experts module of
    ``model`` not under expert parallelism computes as a balanced router would have it
    (`balanced_compute`); under expert parallelism `ExpertParallel.dispatch` does so itself."""
    fqns = expert_fqns(model)
    count = model_facts(model).moe["num_experts"] if fqns else 0
    for fqn in fqns:
        module = model.get_submodule(fqn)
        if "forward" in vars(module):  # (expert parallelism's dispatch)
            continue

        def forward(x, experts, weights, module=module):  # noqa: ANN001, ANN202
            rows = x.repeat_interleave(experts.shape[1], 0)
            return _weighted(balanced_compute(module, rows, count), weights, x.dtype)

        module.forward = forward


def check_experts(model: nn.Module, size: int) -> tuple[list[str], int]:
    """The experts modules ``parallel.ep_size`` = ``size`` divides, and their experts.

    Raises:
        ValueError: a model without routed experts, or experts ``size`` does not divide.
    """
    fqns, moe = expert_fqns(model), model_facts(model).moe
    if not fqns or moe is None:
        raise ValueError(
            f"parallel.ep_size={size}: {type(model).__name__} has no routed experts (no ep_plan, "
            "no Hugging Face mixture's Experts modules); valid: parallel.ep_size=1"
        )
    n = moe["num_experts"]
    if n % size:
        valid = [d for d in range(1, n + 1) if n % d == 0]
        raise ValueError(
            f"parallel.ep_size={size} must divide the model's {n} experts (each rank holds a "
            f"whole share of them); valid choices: {valid}"
        )
    return fqns, n


def apply_expert_parallel(
    model: nn.Module, ep_mesh: DeviceMesh, expert_mesh: DeviceMesh, divide: int
) -> ExpertParallel:
    """Each experts module of the meta-device ``model`` holding this rank's slice of its weights
    (DTensors ``Shard(0)`` on ``ep_mesh``) and dispatching tokens to the group's ranks.

    Args:
        model: the model, on the meta device (before FSDP).
        ep_mesh: the mesh's ``ep`` dimension.
        expert_mesh: what FSDP shards the experts over (`Topology.expert_mesh`).
        divide: the data-parallel ranks the other gradients are averaged over.

    Raises:
        ValueError: as `check_experts`.
    """
    size, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    fqns, n = check_experts(model, size)
    made = ExpertParallel(fqns, ep_mesh.get_group(), size, rank, n, divide, expert_mesh)
    made.params = expert_params(model)
    for fqn in fqns:
        module = model.get_submodule(fqn)
        for name, p in list(module.named_parameters(recurse=False)):
            share = p.shape[0] // size
            local = p.detach()[rank * share : (rank + 1) * share]
            split = DTensor.from_local(
                local, ep_mesh, [Shard(0)], run_check=False, shape=p.shape, stride=p.stride()
            )
            setattr(module, name, nn.Parameter(split, requires_grad=p.requires_grad))
        made.modules.append(module)  # (what `ExpertParallel.divided` finds after FSDP)
        module.forward = _dispatcher(made, fqn, module)
    return made


def _dispatcher(made: ExpertParallel, fqn: str, module: nn.Module):  # noqa: ANN202
    def forward(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return made.dispatch(fqn, module, x, experts, weights)

    return forward
