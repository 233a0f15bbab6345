"""What ``plan.py --fit`` searches: the candidate settings over the asked dimensions (strategy,
precision, checkpointing, offload, micro-batch, gradient sync, where AdamW's states live, and, when
asked, the tensor and pipeline parallel layout), each as overrides."""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from fsdp_zero.config.checks import split_sizes
from fsdp_zero.config.choices import ActivationCheckpointing, StateTier
from fsdp_zero.config.rules import validate
from fsdp_zero.config.schema import Config
from fsdp_zero.config.strategies import STRATEGIES, Strategy
from fsdp_zero.data.loader import BatchLayout
from fsdp_zero.distributed.topology import Role, Topology
from fsdp_zero.sharding.levers import BY_NAME, GRAD_SYNC, OFFLOAD, OFFLOAD_STATES, Lever
from fsdp_zero.tools.formulas import PLAN_MODES
from fsdp_zero.tools.layout import Workload

# The levers --search may vary, by their --search name: each row's `search` values, its first key
# the override (`fsdp_zero.sharding.levers`); offload_states' a (tier, ratio) pair, its first two
# keys' (`_WIDTH`), the tiers at each of `OFFLOAD_RATIOS`
SEARCHED: dict[str, Lever] = {
    "offload": OFFLOAD,
    "grad_sync": GRAD_SYNC,
    "offload_states": OFFLOAD_STATES,
}
# how many of a searched row's keys its value sets (a tuple of that many when more than one)
_WIDTH = {OFFLOAD_STATES.name: 2}
# offload.ratio's values searched with a tier (a fraction of the step groups, the last ones)
OFFLOAD_RATIOS = (0.25, 0.5, 0.75, 1.0)


def _settings(row: Lever, value: object) -> dict[str, object]:
    """The keys a searched ``value`` of ``row`` sets, and their values."""
    width = _WIDTH.get(row.name, 1)
    return dict(zip(row.keys[:width], value if width > 1 else (value,)))


def _own(row: Lever, cfg: Config | Workload) -> object:
    """``row``'s searched value in ``cfg`` (a tuple of its first keys' where it sets several)."""
    values = tuple(row.value(cfg, k) for k in range(_WIDTH.get(row.name, 1)))
    return values if len(values) > 1 else values[0]


# The value that leaves each searched row off (its other keys at their defaults)
_OFF = {row.name: _own(row, Config()) for row in SEARCHED.values()}


def lever_values(values: Mapping[str, object] | None = None) -> tuple[tuple[str, object], ...]:
    """(row name, value) of each `SEARCHED` lever, in its order: ``values``' (by row name), else the
    value that leaves it off."""
    return tuple(
        (row.name, (values or {}).get(row.name, _OFF[row.name])) for row in SEARCHED.values()
    )


def _text(value: object) -> str:
    """``value`` as an override writes it (true/false, an enum's value)."""
    return str(value).lower() if isinstance(value, bool) else str(getattr(value, "value", value))


@dataclass(frozen=True)
class Candidate:
    strategy: Strategy
    precision: str
    checkpointing: ActivationCheckpointing
    micro_batch: int
    # the `SEARCHED` levers' values, (row name, value) in its order (`lever_values`)
    levers: tuple[tuple[str, object], ...] = lever_values()
    # the sizes of the axes that split the model, (axis, parallel.<axis>_size) as
    # `fsdp_zero.config.checks.split_sizes` orders them
    split: tuple[tuple[str, int], ...] = (("ep", 1), ("sp", 1), ("tp", 1), ("pp", 1))
    # train.loss_chunk: tokens per chunk of the tiled loss (0: the micro-batch's logits at once)
    loss_chunk: int = 0

    def value(self, lever: str) -> Any:
        """The value of the lever named ``lever`` (its row's name, e.g. ``grad_sync``)."""
        return dict(self.levers)[lever]

    def size(self, axis: str) -> int:
        """The ranks ``axis`` splits the model over (1: not split along it)."""
        return dict(self.split).get(axis, 1)

    @property
    def layered(self) -> bool:
        """Tensor, pipeline or sequence parallel: its peak and cost by formula
        (`fsdp_zero.tools.layout`); expert parallelism is simulated as it is."""
        return any(size > 1 for axis, size in self.split if axis != "ep")

    def overrides(self) -> list[str]:
        """The key=value overrides that select this candidate, to paste onto the command line."""
        each = {
            "strategy": [f"parallel.strategy={self.strategy.value}"],
            "precision": [f"precision.mode={self.precision}"],
            "checkpointing": [f"parallel.activation_checkpointing={self.checkpointing.value}"],
            "micro_batch": [f"train.micro_batch_size={self.micro_batch}"],
            "layout": [f"parallel.{axis}_size={size}" for axis, size in self.split],
            "loss_chunk": [f"train.loss_chunk={self.loss_chunk}"],
        }
        for name, row in SEARCHED.items():
            settings = _settings(row, self.value(row.name))
            each[name] = [f"{key}={_text(value)}" for key, value in settings.items()]
        return [override for name in DIMENSIONS for override in each[name]]

    def on(self, w: Workload) -> Workload:
        """``w`` with this candidate's settings: its parallel layout and levers, precision mode and
        micro-batch."""
        # full_shard's own
        hpz = w.parallel.reshard_after_forward if STRATEGIES[self.strategy].hpz else None
        # the levers' keys, by section (parallel.<key>, offload.<key>)
        levers: dict[str, dict[str, object]] = {"parallel": {}, "offload": {}}
        for name, value in self.levers:
            for dotted, v in _settings(BY_NAME[name], value).items():
                section, key = dotted.split(".")
                levers[section][key] = v
        p = replace(
            w.parallel,
            strategy=self.strategy,
            activation_checkpointing=self.checkpointing,
            reshard_after_forward=hpz,
            **levers["parallel"],
            **{f"{axis}_size": size for axis, size in self.split},
        )
        return replace(
            w,
            parallel=p,
            precision=replace(w.precision, mode=self.precision),
            train=replace(w.train, micro_batch_size=self.micro_batch, loss_chunk=self.loss_chunk),
            offload=replace(w.offload, **levers["offload"]),
        )

    def config(self, cfg: Config) -> Config:
        """``cfg`` with this candidate's settings (`on` its parts): the config a run of it loads."""
        w = self.on(Workload.of(cfg))
        return replace(
            cfg, parallel=w.parallel, precision=w.precision, train=w.train, offload=w.offload
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
# "offload_states": offload.states x offload.ratio (`OFFLOAD_RATIOS`): the cpu tier where the run
# targets CUDA, the disk tier where offload.path names a folder. "layout": every parallel.sp_size x
# parallel.tp_size x parallel.pp_size the world size divides into (parallel.ep_size as configured).
# "loss_chunk": the logits at once, or the tiled loss in chunks of `LOSS_CHUNK` tokens (where a micro-batch has more).
DIMENSIONS = (
    "strategy",
    "precision",
    "checkpointing",
    "offload",
    "micro_batch",
    "grad_sync",
    "offload_states",
    "layout",
    "loss_chunk",
)
# What --fit searches unless told: all but the layout (on a CPU host tensor, pipeline and sequence
# parallelism prove correctness, not speed; ask for them with --search ...,layout) and the tiled
# loss (--search ...,loss_chunk).
DEFAULT_SEARCH = DIMENSIONS[:-2]
LOSS_CHUNK = 1024


def searched_overrides(search: tuple[str, ...]) -> list[str]:
    """What loading the config for a search adds to its overrides: the micro-batch, when searched (every
    divisor of the local batch is a candidate), is 1, so that the config's own (a default the user
    may never have set) cannot refuse a global batch it does not divide."""
    return ["train.micro_batch_size=1"] if "micro_batch" in search else []


@dataclass(frozen=True)
class FitSearch:
    """One search of `plan.py fit`: the config its candidates vary, the ranks, and the dimensions
    searched. The one object of the fit that holds the whole config: the rest takes a candidate,
    the config's parts (`Workload`) or this."""

    cfg: Config
    world_size: int
    dims: tuple[str, ...] = DEFAULT_SEARCH

    @property
    def base(self) -> Workload:
        """The config's parts the formulas read; a candidate's are `Candidate.on` them."""
        return Workload.of(self.cfg)

    @property
    def own(self) -> Candidate:
        """The config's own settings, as a candidate."""
        p = self.cfg.parallel
        return Candidate(
            strategy=p.strategy,
            precision=self.cfg.precision.mode,
            checkpointing=p.activation_checkpointing,
            micro_batch=self.cfg.train.micro_batch_size,
            levers=lever_values({row.name: _own(row, self.cfg) for row in SEARCHED.values()}),
            split=tuple(split_sizes(p).items()),
            loss_chunk=self.cfg.train.loss_chunk,
        )

    def candidates(self) -> list[Candidate]:
        """Every valid candidate: the config's own model, data, global batch and other settings, with
        each strategy, precision mode, checkpointing, offload, micro-batch, grad_sync and layout the
        config allows (those of the dimensions not in ``dims`` as the config sets them).

        Raises:
            ValueError: ``dims`` names something other than `DIMENSIONS`; no candidate is valid.
        """
        search, world_size = self.dims, self.world_size
        for name in search:
            if name not in DIMENSIONS:
                raise ValueError(
                    f"--search={','.join(search)}: {name!r} is not a valid choice; valid choices: "
                    f"{', '.join(DIMENSIONS)}"
                )
        out, refused = [], None
        global_batch = self.cfg.train.global_batch_size
        choices = _values(self.own, global_batch, self.base, world_size, search)
        for values in itertools.product(*choices.values()):
            pick = dict(zip(choices, values))
            cand = Candidate(
                pick["strategy"],
                pick["precision"],
                pick["checkpointing"],
                pick["micro_batch"],
                lever_values({row.name: pick[name] for name, row in SEARCHED.items()}),
                split=pick["layout"],
                loss_chunk=pick["loss_chunk"],
            )
            # per data-parallel rank
            local = global_batch * math.prod(s for _, s in cand.split) // world_size
            if (
                "grad_sync" in search
                and local // cand.micro_batch == 1
                and cand.value(GRAD_SYNC.name) != GRAD_SYNC.off
            ):
                continue  # without accumulation every mode reduces once: the default stands for them
            tokens = cand.micro_batch * self.cfg.data.seq_len // cand.size("sp")
            if cand.loss_chunk >= max(tokens, 1):
                continue  # one chunk: the logits at once
            try:
                c = cand.config(self.cfg)
                validate(c)
                topology = Topology.of(c.parallel, world_size)
                BatchLayout.of(c.train, topology.size(Role.BATCH))
            except (
                ValueError
            ) as e:  # e.g. bf16-mixed under DDP, offload or once_per_step without FSDP
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


def _values(
    own: Candidate, global_batch: int, base: Workload, world_size: int, search: tuple[str, ...]
) -> dict[str, list[Any]]:
    """Each dimension's values, in `DIMENSIONS` order: every choice where ``search`` names it, else
    the config's own (``own``). Micro-batches: the divisors of the most samples a data-parallel rank
    may take of ``global_batch`` (a layout's own divide fewer: `FitSearch.candidates` drops the
    rest). A lever that moves state to the host (offload, offload.states=cpu) only where the run
    targets CUDA (``base``'s device): on a CPU host it moves nothing; the disk tier only where
    ``base`` names a folder for it (offload.path)."""
    cuda = base.cuda
    divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
    # (expert parallelism is not searched: the config's ep_size stays, simulated as it is)
    each = [[size] if axis == "ep" else divisors for axis, size in own.split]
    layouts = [
        tuple(zip(dict(own.split), sizes))
        for sizes in itertools.product(*each)
        if world_size % math.prod(sizes) == 0
    ]
    if "layout" not in search:
        layouts = [own.split]
    split = max(math.prod(s for _, s in layout) for layout in layouts)
    local = global_batch * split // world_size
    axes = {
        "strategy": list(STRATEGIES),
        "precision": list(PLAN_MODES),
        "checkpointing": list(ActivationCheckpointing),
        "micro_batch": [m for m in range(1, local + 1) if local % m == 0],
        "layout": layouts,
        "loss_chunk": [0, LOSS_CHUNK],
    }
    fixed = {
        "strategy": [own.strategy],
        "precision": [own.precision],
        "checkpointing": [own.checkpointing],
        "micro_batch": [own.micro_batch],
        "layout": [own.split],
        "loss_chunk": [own.loss_chunk],
    }
    for name, row in SEARCHED.items():
        axes[name] = [v for v in row.search if cuda or not row.on_host or v == row.off]
        fixed[name] = [own.value(row.name)]
    tiers = {StateTier.cpu: cuda, StateTier.disk: bool(OFFLOAD_STATES.value(base, 2))}  # a path
    axes["offload_states"] = [_OFF[OFFLOAD_STATES.name]] + [
        (tier, ratio)
        for tier in OFFLOAD_STATES.search
        if tiers.get(tier)
        for ratio in OFFLOAD_RATIOS
    ]
    return {d: axes[d] if d in search else fixed[d] for d in DIMENSIONS}
