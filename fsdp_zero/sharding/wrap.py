"""Wrap policies: which submodules become FSDP units, decided as data before any sharding.

A unit's parameters are all-gathered together before its forward and backward and
freed together after (ZeRO-3), so the largest unit bounds the extra memory of the
gathered parameters; with policy ``none`` the whole model is one unit and every rank
briefly holds the full model. The plan lists the units bottom-up, then the root,
which is the order ``fully_shard`` must be applied in.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from torch import nn

from fsdp_zero.config.choices import WrapPolicy
from fsdp_zero.config.schema import WrapConfig
from fsdp_zero.model.contract import model_facts
from fsdp_zero.sharding.experts import expert_fqns

ROOT_FQN = ""
# Containers have no forward of their own, so FSDP hooks on them would never fire.
_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)


@dataclass(frozen=True)
class _Unit:
    fqn: str  # "" for the root
    class_name: str
    num_params: int  # parameters this unit owns (not those of units nested in it)
    full_bytes: int
    bytes_per_rank: int  # padded shard, as FSDP2 allocates it (dim 0 split in ceil(rows / N))
    # Chosen by the policy for itself (a transformer block), not as a large module outside the
    # blocks (an embedding table, an output head) nor the root: where activation checkpointing and
    # per-unit compilation apply.
    block: bool = False


@dataclass(frozen=True)
class WrapPlan:
    policy: WrapPolicy
    world_size: int
    units: list[_Unit]  # bottom-up, root last
    notes: list[str] = field(default_factory=list)

    @property
    def submodule_fqns(self) -> list[str]:
        return [u.fqn for u in self.units if u.fqn != ROOT_FQN]

    @property
    def block_fqns(self) -> list[str]:
        return [u.fqn for u in self.units if u.block]

    def last_unit(self, model: nn.Module) -> str | None:
        """The unit (not the root) whose forward runs last, registration order standing for forward
        order (as explicit prefetch assumes): its backward comes next, so it stays gathered from its
        forward to its backward instead of being resharded and gathered again at once (torchtitan
        leaves its last block so). None: the root is the only unit."""
        order = {fqn: i for i, (fqn, _) in enumerate(model.named_modules())}
        return max(self.submodule_fqns, key=order.__getitem__, default=None)

    def table(self) -> str:
        """The plan as a fixed-width table, one row a unit."""
        rows = [("unit", "class", "params", "full MiB", f"MiB/rank (N={self.world_size})")]
        for u in self.units:
            rows.append(
                (
                    u.fqn or "<root>",
                    u.class_name,
                    f"{u.num_params:,}",
                    _mib(u.full_bytes),
                    _mib(u.bytes_per_rank),
                )
            )
        total = sum(u.num_params for u in self.units)
        rows.append(
            (
                "total",
                f"{len(self.units)} units",
                f"{total:,}",
                _mib(sum(u.full_bytes for u in self.units)),
                _mib(sum(u.bytes_per_rank for u in self.units)),
            )
        )
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = [f"wrap plan: policy={self.policy.value}, {len(self.units)} FSDP units"]
        for i, r in enumerate(rows):
            cells = [r[0].ljust(widths[0]), r[1].ljust(widths[1])] + [
                c.rjust(w) for c, w in zip(r[2:], widths[2:])
            ]
            lines.append("  " + "  ".join(cells))
            if i == 0 or i == len(rows) - 2:
                lines.append("  " + "  ".join("-" * w for w in widths))
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def _mib(n: int) -> str:
    return f"{n / 2**20:,.2f}"


def _block_classes(model: nn.Module, cfg: WrapConfig) -> tuple[list[str], str | None]:
    """The transformer policy's block classes, and a note for the plan when they were found rather
    than named or declared.

    ``parallel.wrap.classes`` first, then what the model declares: a ``block_class`` attribute (the
    built-in model), or Hugging Face's ``_no_split_modules`` (what Accelerate wraps by default),
    keeping the classes the model holds.
    Otherwise found (`_repeated_classes`): the class repeated in the model's outermost
    ``ModuleList`` or ``Sequential``, the shape in which users write a stack of blocks (nanoGPT's
    ``h``, torchvision's ``layers``). [] when neither gives one.
    """
    if cfg.classes:
        return list(cfg.classes), None
    facts = model_facts(model)
    if facts.block_class is not None:
        return [facts.block_class.__name__], None
    declared = facts.no_split_modules
    present = {type(m).__name__ for m in model.modules()}
    if declared:
        return [c for c in declared if c in present], None
    found = _repeated_classes(model)
    if not found:
        return [], None
    classes = list(dict.fromkeys(cls for _, _, cls in found))
    where = "; ".join(
        f"{cls}, repeated in " + ", ".join(f"{fqn} ({n})" for fqn, n, c in found if c == cls)
        for cls in classes
    )
    note = (
        f"blocks found, not declared: {where}; to wrap other classes, set parallel.wrap.classes "
        f"(e.g. parallel.wrap.classes=[{classes[0]}])"
    )
    return classes, note


def _repeated_classes(model: nn.Module) -> list[tuple[str, int, str]]:
    """``(fqn, count, class)`` for each outermost ``ModuleList`` or ``Sequential`` whose children
    are at least two modules of one class that holds parameters; those nested in another's children
    are left out (an attention's list of heads inside a block)."""
    found: list[tuple[str, int, str]] = []
    for fqn, module in model.named_modules():  # parents before their children
        if not isinstance(module, (nn.ModuleList, nn.Sequential)) or any(
            fqn.startswith(f"{outer}.") for outer, _, _ in found
        ):
            continue
        children = list(module.children())
        kinds = {type(child) for child in children}
        if (
            len(children) >= 2
            and len(kinds) == 1
            and next(children[0].parameters(), None) is not None
        ):
            found.append((fqn, len(children), type(children[0]).__name__))
    return found


def _select(model: nn.Module, cfg: WrapConfig, classes: list[str] | None) -> list[str]:
    """FQNs of the submodules the policy picks (not the root); ``classes``: the transformer policy's
    (`_block_classes`).

    Raises:
        ValueError: an unknown class name, or a policy that matches no module.
    """
    named = [(fqn, m) for fqn, m in model.named_modules() if fqn != ROOT_FQN]
    if cfg.policy is WrapPolicy.none:
        return []
    if cfg.policy is WrapPolicy.transformer:
        return _select_blocks(model, classes or [], named)
    if cfg.policy is WrapPolicy.modules:
        return _select_by_name(cfg, [fqn for fqn, _ in named])
    if cfg.policy is WrapPolicy.size_based:
        return _select_by_size(cfg, named)
    raise AssertionError(cfg.policy)


def _select_blocks(
    model: nn.Module, classes: list[str], named: list[tuple[str, nn.Module]]
) -> list[str]:
    """The transformer policy: every module of a block class, and the large outsiders."""
    present = sorted({type(m).__name__ for _, m in named})
    if not classes:
        raise ValueError(
            f"parallel.wrap.policy=transformer: {type(model).__name__} declares no block class "
            "(no _no_split_modules, no block_class) and repeats none in a ModuleList or Sequential; "
            "set parallel.wrap.classes to the repeated block, e.g. parallel.wrap.classes=[...]; "
            f"this model's module classes: {', '.join(present)}"
        )
    unknown = [c for c in classes if c not in present]
    if unknown:
        raise ValueError(
            f"parallel.wrap.classes: unknown module class {', '.join(map(repr, unknown))}; "
            f"this model has: {', '.join(present)}"
        )
    blocks = [fqn for fqn, m in named if type(m).__name__ in classes]
    return _with_large_outsiders(named, blocks)


def _select_by_name(cfg: WrapConfig, fqns: list[str]) -> list[str]:
    """The modules policy: every module whose FQN a pattern matches whole, in model order."""
    chosen: list[str] = []
    for pattern in cfg.modules:  # each a valid regex (WrapConfig.check)
        rx = re.compile(pattern)
        hits = [f for f in fqns if rx.fullmatch(f)]
        if not hits:
            sample = ", ".join(fqns[:12]) + (", ..." if len(fqns) > 12 else "")
            raise ValueError(
                f"parallel.wrap.modules: {pattern!r} matches no module (patterns must match "
                f"the whole FQN); module FQNs: {sample}"
            )
        chosen += [f for f in hits if f not in chosen]
    return [f for f in fqns if f in chosen]  # model order


def _select_by_size(cfg: WrapConfig, named: list[tuple[str, nn.Module]]) -> list[str]:
    """The size_based policy."""
    # FSDP1's size_based_auto_wrap_policy: bottom-up, a module becomes a unit when the
    # parameters it holds outside units already chosen below it reach min_params.
    chosen, owned = [], set()
    largest = 0
    for fqn, module in sorted(named, key=lambda x: -x[0].count(".")):
        if isinstance(module, _CONTAINERS):
            continue
        params = {id(p): p.numel() for p in module.parameters() if id(p) not in owned}
        remaining = sum(params.values())
        largest = max(largest, remaining)
        if remaining >= cfg.min_params:
            chosen.append(fqn)
            owned |= params.keys()
    if not chosen:
        raise ValueError(
            f"parallel.wrap.min_params={cfg.min_params:,} matches no module (the largest "
            f"submodule holds {largest:,} parameters); lower it or use "
            "parallel.wrap.policy=none"
        )
    return [fqn for fqn, _ in named if fqn in chosen]


def _parameter_paths(model: nn.Module) -> tuple[dict[int, list[str]], dict[int, object]]:
    """Every module path through which each parameter is reachable (tied weights: several), and the
    parameters, both by id."""
    users: dict[int, list[str]] = {}
    params: dict[int, object] = {}
    for mod_fqn, module in model.named_modules(remove_duplicate=False):
        for name, p in module.named_parameters(recurse=False, remove_duplicate=False):
            users.setdefault(id(p), []).append(f"{mod_fqn}.{name}" if mod_fqn else name)
            params[id(p)] = p
    return users, params


def _unit(
    model: nn.Module, fqn: str, ps: list[nn.Parameter], world_size: int, classes: list[str] | None
) -> _Unit:
    """The unit at ``fqn`` owning ``ps``: its sizes in full and per rank (dim 0 padded to the world
    size, as FSDP2 shards), and whether it is a block (of ``classes``; None: any unit)."""
    module = model.get_submodule(fqn) if fqn else model
    full = sum(p.numel() * p.element_size() for p in ps)
    per_rank = sum(
        math.ceil(p.shape[0] / world_size) * math.prod(p.shape[1:]) * p.element_size()
        if p.dim()
        else p.element_size()
        for p in ps
    )
    block = fqn != ROOT_FQN and (classes is None or type(module).__name__ in classes)
    return _Unit(
        fqn,
        type(module).__name__,
        num_params=sum(p.numel() for p in ps),
        full_bytes=full,
        bytes_per_rank=per_rank,
        block=block,
    )


def _with_large_outsiders(named: list[tuple[str, nn.Module]], blocks: list[str]) -> list[str]:
    """The blocks, plus each outermost module outside them (not a block's ancestor either) that holds
    at least as many parameters as the largest block: a language model's embedding table and output
    head. As units of their own their gathered parameters, unsharded gradients and reduce-scatter
    buffers are each one table, not both at once in the root (torchtitan shards them the same way).
    Tied ones fall back to the root (see `build_wrap_plan`)."""
    if not blocks:
        return blocks
    sizes = {fqn: sum(p.numel() for p in m.parameters()) for fqn, m in named}
    largest = max(sizes[b] for b in blocks)
    chosen: list[str] = []
    for fqn, module in named:
        related = any(_is_under(fqn, b) or _is_under(b, fqn) for b in blocks + chosen)
        if not related and not isinstance(module, _CONTAINERS) and sizes[fqn] >= largest > 0:
            chosen.append(fqn)
    return [fqn for fqn, _ in named if fqn in blocks or fqn in chosen]


def _depth(fqn: str) -> int:
    return -1 if fqn == ROOT_FQN else fqn.count(".")


def _is_under(fqn: str, unit: str) -> bool:
    return unit == ROOT_FQN or fqn == unit or fqn.startswith(unit + ".")


def build_wrap_plan(model: nn.Module, cfg: WrapConfig, shards: int) -> WrapPlan:
    """Chooses the units and what each owns. Works on the meta device. ``shards``: the ranks each
    parameter is split over (`fsdp_zero.distributed.topology.Topology.param_shards`), which the
    per-rank sizes are for.

    A parameter shared by modules in different units (tied embeddings) must be sharded
    once: any chosen unit that holds only some of a shared parameter's users is dropped,
    so the parameter falls to the closest unit above that holds them all.

    Raises:
        ValueError: as `_select`.
    """
    classes, found = (
        _block_classes(model, cfg) if cfg.policy is WrapPolicy.transformer else (None, None)
    )
    selected = _select(model, cfg, classes)
    # a mixture's routed experts: units of their own (the ones expert parallelism shards over its
    # own mesh; torchtitan's fully_shard of each block's experts)
    if cfg.policy is not WrapPolicy.none:
        selected += [f for f in expert_fqns(model) if f not in selected]
    for fqn in selected:
        module = model.get_submodule(fqn)
        if isinstance(module, _CONTAINERS):
            raise ValueError(
                f"parallel.wrap: '{fqn}' is a {type(module).__name__}, a container that is never "
                "called; FSDP gathers parameters in forward hooks, so wrap its children instead "
                f"(e.g. '{fqn}\\.\\d+')"
            )
    notes = [found] if found else []
    users, params = _parameter_paths(model)
    for paths in users.values():
        if len(paths) < 2:
            continue
        for unit in list(selected):
            inside = [q for q in paths if _is_under(q, unit)]
            if inside and len(inside) < len(paths):
                selected.remove(unit)
                notes.append(
                    f"'{unit}' is not a unit of its own: it shares {inside[0]} with "
                    f"{', '.join(q for q in paths if q not in inside)}"
                )

    # Each parameter belongs to the deepest chosen unit above its first path.
    units = sorted(selected, key=_depth, reverse=True) + [ROOT_FQN]  # bottom-up, root last
    owned: dict[str, list[object]] = {u: [] for u in units}
    for pid, paths in users.items():
        owner = next(u for u in units if all(_is_under(q, u) for q in paths))
        owned[owner].append(params[pid])

    # The transformer policy's large outsiders (see `_with_large_outsiders`) are not blocks.
    plan_units = [_unit(model, fqn, owned[fqn], shards, classes) for fqn in units]
    if cfg.policy is WrapPolicy.none:
        notes.append("one unit: every rank gathers the whole model for forward and backward")
    return WrapPlan(policy=cfg.policy, world_size=shards, units=plan_units, notes=notes)
