"""What ``plan.py --fit`` searches: the candidate settings over the asked dimensions (strategy,
precision, checkpointing, offload, micro-batch, gradient sync, and, when asked, the tensor and
pipeline parallel layout), each as overrides."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace
from typing import Any

from fsdp_zero.config.choices import ActivationCheckpointing
from fsdp_zero.config.rules import validate
from fsdp_zero.config.schema import Config
from fsdp_zero.config.strategies import STRATEGIES, GradSync, Strategy
from fsdp_zero.data.loader import BatchLayout
from fsdp_zero.distributed.topology import Topology
from fsdp_zero.tools.formulas import PLAN_MODES


@dataclass(frozen=True)
class Candidate:
    strategy: Strategy
    precision: str
    checkpointing: ActivationCheckpointing
    offload: bool
    micro_batch: int
    grad_sync: GradSync
    tp: int = 1  # parallel.tp_size
    pp: int = 1  # parallel.pp_size

    @property
    def layered(self) -> bool:
        """Tensor or pipeline parallel: its peak and cost by formula (`fsdp_zero.tools.layout`)."""
        return self.tp > 1 or self.pp > 1

    def overrides(self) -> list[str]:
        """The key=value overrides that select this candidate, to paste onto the command line."""
        return [
            f"parallel.strategy={self.strategy.value}",
            f"precision.mode={self.precision}",
            f"parallel.activation_checkpointing={self.checkpointing.value}",
            f"parallel.cpu_offload={str(self.offload).lower()}",
            f"train.micro_batch_size={self.micro_batch}",
            f"parallel.grad_sync={self.grad_sync.value}",
            f"parallel.tp_size={self.tp}",
            f"parallel.pp_size={self.pp}",
        ]

    def config(self, cfg: Config) -> Config:
        # full_shard's own
        hpz = cfg.parallel.reshard_after_forward if STRATEGIES[self.strategy].hpz else None
        p = replace(
            cfg.parallel,
            strategy=self.strategy,
            activation_checkpointing=self.checkpointing,
            cpu_offload=self.offload,
            grad_sync=self.grad_sync,
            reshard_after_forward=hpz,
            tp_size=self.tp,
            pp_size=self.pp,
        )
        return replace(
            cfg,
            parallel=p,
            precision=replace(cfg.precision, mode=self.precision),
            train=replace(cfg.train, micro_batch_size=self.micro_batch),
        )


@dataclass
class Scored:
    candidate: Candidate
    peak: int  # predicted bytes per rank (CPU: peak RSS; CUDA: device memory)
    # seconds per optimizer step under the rates: compute + communication + offload copies
    cost: float
    parts: dict[str, float] = field(default_factory=dict)  # the cost's terms
    fits: bool = False

    def to_json(self) -> dict:
        return {
            "overrides": self.candidate.overrides(),
            "peak_bytes": self.peak,
            "fits": self.fits,
            "cost": self.cost,
            "cost_parts": self.parts,
        }


# What --search may name: the settings a candidate varies (the others stay as the config has them).
# "layout": every parallel.tp_size x parallel.pp_size the world size divides into.
DIMENSIONS = (
    "strategy",
    "precision",
    "checkpointing",
    "offload",
    "micro_batch",
    "grad_sync",
    "layout",
)
# What --fit searches unless told: all but the layout (on a CPU host tensor and pipeline
# parallelism prove correctness, not speed; ask for them with --search ...,layout).
DEFAULT_SEARCH = DIMENSIONS[:-1]


def searched_overrides(search: tuple[str, ...]) -> list[str]:
    """What loading the config for a search adds to its overrides: the micro-batch, when searched (every
    divisor of the local batch is a candidate), is 1, so that the config's own (a default the user
    may never have set) cannot refuse a global batch it does not divide."""
    return ["train.micro_batch_size=1"] if "micro_batch" in search else []


def candidates(
    cfg: Config, world_size: int, search: tuple[str, ...] = DEFAULT_SEARCH
) -> list[Candidate]:
    """Every valid candidate: the config's own model, data, global batch and other settings, with each
    strategy, precision mode, checkpointing, offload, micro-batch, grad_sync and layout the config
    allows (those of the dimensions not in ``search`` as the config sets them).

    Raises:
        ValueError: ``search`` names something other than `DIMENSIONS`; no candidate is valid.
    """
    for name in search:
        if name not in DIMENSIONS:
            raise ValueError(
                f"--search={','.join(search)}: {name!r} is not a valid choice; valid choices: "
                f"{', '.join(DIMENSIONS)}"
            )
    out, refused = [], None
    for *values, (tp, pp) in itertools.product(*_values(cfg, world_size, search)):
        cand = Candidate(*values, tp=tp, pp=pp)
        local = cfg.train.global_batch_size * tp * pp // world_size  # per data-parallel rank
        if (
            "grad_sync" in search
            and local // cand.micro_batch == 1
            and cand.grad_sync is not GradSync.every_micro_batch
        ):
            continue  # without accumulation every mode reduces once: the default stands for them
        try:
            c = cand.config(cfg)
            validate(c)
            topology = Topology.of(c.parallel, world_size)
            BatchLayout.of(c.train, topology.dp_size)
        except ValueError as e:  # e.g. bf16-mixed under DDP, offload or once_per_step without FSDP
            refused = e
            continue
        if topology.spec.hybrid and topology.replicas == 1 and "strategy" in search:
            continue  # one replica: full_shard's twin
        out.append(cand)
    if not out:
        raise ValueError(
            f"no setting varying {', '.join(search)} is valid for this config at {world_size} "
            f"ranks; the last refused: {refused}"
        )
    return out


def _values(cfg: Config, world_size: int, search: tuple[str, ...]) -> list[list[Any]]:
    """Each dimension's values, in `DIMENSIONS` order: every choice where ``search`` names it, else
    the config's own. Micro-batches: the divisors of the most samples a data-parallel rank may
    take (a layout's own divide fewer: `candidates` drops the rest)."""
    p = cfg.parallel
    divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
    layouts = [(t, q) for t in divisors for q in divisors if world_size % (t * q) == 0]
    if "layout" not in search:
        layouts = [(p.tp_size, p.pp_size)]
    local = cfg.train.global_batch_size * max(t * q for t, q in layouts) // world_size
    axes = {
        "strategy": list(STRATEGIES),
        "precision": list(PLAN_MODES),
        "checkpointing": list(ActivationCheckpointing),
        # On a CPU host offload moves nothing: not a candidate there.
        "offload": [False, True] if cfg.dist.device.value == "cuda" else [False],
        "micro_batch": [m for m in range(1, local + 1) if local % m == 0],
        "grad_sync": list(GradSync),
        "layout": layouts,
    }
    fixed = {
        "strategy": [p.strategy],
        "precision": [cfg.precision.mode],
        "checkpointing": [p.activation_checkpointing],
        "offload": [p.cpu_offload],
        "micro_batch": [cfg.train.micro_batch_size],
        "grad_sync": [p.grad_sync],
        "layout": [(p.tp_size, p.pp_size)],
    }
    return [axes[d] if d in search else fixed[d] for d in DIMENSIONS]
