"""The lever table (`fsdp_zero.sharding.levers.LEVERS`): every row names keys the schema has, is off
at the defaults and on when its key is set, the rows run in stage order, and what the build reads
from them (the state device, the recomputed blocks, `Built`'s facets) without a process group.
The build itself is checked against one process by tests/test_parity.py, lever by lever.

Covers: fsdp_zero/sharding/levers.py, fsdp_zero/sharding/build.py
"""

from __future__ import annotations

import ast
import dataclasses

import pytest
import torch

from fsdp_zero.config.checks import grid_axes
from fsdp_zero.config.choices import ActivationCheckpointing, Quantize, StateTier
from fsdp_zero.config.schema import Config, ParallelConfig
from fsdp_zero.distributed.env import DistEnv
from fsdp_zero.distributed.topology import Topology
from fsdp_zero.sharding.build import Built
from fsdp_zero.sharding.levers import (
    BY_NAME,
    LEVERS,
    NF4,
    OFFLOAD,
    BuildContext,
    Stage,
    active_levers,
    checkpointed,
)
from tests.conftest import REPO

GRID = grid_axes(ParallelConfig)
CPU = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")

# one setting that turns each lever on
ON = {
    "nf4": ("model", "lora", "quantize", Quantize.nf4),
    "float8": ("precision", "float8", "tensorwise"),
    "pipeline": ("parallel", "pp_size", 2),
    "tensor": ("parallel", "tp_size", 2),
    "activation_checkpointing": ("parallel", "activation_checkpointing", "full"),
    "activation_offload": ("parallel", "activation_offload", True),
    "sequence": ("parallel", "sp_size", 2),
    "expert": ("parallel", "ep_size", 2),
    "compile": ("train", "compile", True),
    "cpu_offload": ("parallel", "cpu_offload", True),
    "prefetch": ("parallel", "prefetch", 1),
    "low_bit_adamw": ("optim", "state_bits", 8),
    "step_groups": ("optim", "step_group_size", 1000),
    "offload_states": ("offload", "states", StateTier.cpu),
    "grad_sync": ("parallel", "grad_sync", "once_per_step"),
}


def _with(cfg: Config, *path_and_value: object) -> Config:
    """``cfg`` with one nested field replaced (no checks run: the rows read what is there)."""
    *path, value = path_and_value
    if len(path) == 1:
        return dataclasses.replace(cfg, **{path[0]: value})
    inner = getattr(cfg, path[0])
    return dataclasses.replace(cfg, **{path[0]: _with(inner, *path[1:], value)})


def test_every_row_names_keys_the_schema_has_and_is_off_by_default():
    cfg = Config()
    assert active_levers(cfg) == []
    assert len(BY_NAME) == len(LEVERS) and set(ON) == set(BY_NAME)
    for lever in LEVERS:
        for i, _ in enumerate(lever.keys):
            lever.value(cfg, i)  # an AttributeError names a key the schema lacks
        assert lever.value(cfg) == lever.off, lever.name


@pytest.mark.parametrize("name", sorted(ON))
def test_its_key_turns_each_row_on_and_no_other(name):
    cfg = _with(Config(), *ON[name])
    assert [lever.name for lever in active_levers(cfg)] == [name]


def test_the_rows_run_in_stage_order_and_each_stage_has_its_apply():
    stages = [lever.stage for lever in LEVERS]
    assert stages == sorted(stages)
    for lever in LEVERS:
        # the stages the build path runs call `apply` (OPTIMIZER's: the optimizer the step calls,
        # where it has one); the others' rows are read by facets
        applied = lever.stage in (
            Stage.CONVERT,
            Stage.CUT,
            Stage.SPLIT,
            Stage.RECOMPUTE,
            Stage.COMPILE,
        )
        if lever.stage is Stage.OPTIMIZER:
            assert lever.apply is None or lever.cuts_groups, lever.name
        else:
            assert (lever.apply is not None) == applied, lever.name


@pytest.mark.parametrize(
    "how, every, expected",
    [
        ("none", 2, []),
        ("full", 2, ["b1", "b2", "b3", "b4"]),
        ("selective", 2, ["b2", "b4"]),
        ("selective", 3, ["b3"]),
    ],
)
def test_checkpointed_blocks(how, every, expected):
    cfg = _with(Config(), "parallel", "activation_checkpointing", ActivationCheckpointing(how))
    cfg = _with(cfg, "parallel", "activation_checkpointing_every", every)
    assert checkpointed(cfg, ["b1", "b2", "b3", "b4"]) == expected


def test_the_context_keeps_each_active_levers_setting_and_offload_moves_the_state_to_the_host():
    cfg = _with(Config(), *ON["cpu_offload"])
    ctx = BuildContext(cfg, CPU, Topology.of(cfg.parallel, 1))
    assert ctx.made == {"cpu_offload": True} and ctx.at(Stage.SHARD) == [OFFLOAD]
    assert ctx.state_device() == torch.device("cpu") and not ctx.fills_base()
    assert set(ctx.facets("fsdp_kwargs")[0][0](ctx)) == {"offload_policy"}


@dataclasses.dataclass
class _NF4Fields:
    """The fields of `fsdp_zero.sharding.quantize.NF4Base` that NF4's facets read."""

    names: dict[str, str]
    gathered: dict[str, float]
    numel: int
    rank_bytes: float


def test_built_reads_its_facts_from_the_levers_it_holds():
    """QLoRA's base (a stand-in with its fields) is left out of checkpoints, gathered as NF4 and
    counted in the model-state formula; without levers `Built` is the plain model's."""
    model = torch.nn.Linear(4, 4)
    plain = Built(
        model=model,
        optimizer=torch.optim.SGD(model.parameters()),
        plan=None,
        num_params=20,
        precision=None,
        topology=None,
    )
    assert plain.rebuilt == frozenset() and plain.gathered_bytes == {} and plain.notes() == []
    assert plain.whole is model and plain.cut_from is None and plain.rank_params == 20
    base = _NF4Fields(names={"weight": "w"}, gathered={"weight": 10.0}, numel=16, rank_bytes=8.0)
    qlora = dataclasses.replace(plain, levers={NF4.name: base})
    assert qlora.rebuilt == frozenset({"weight"}) and qlora.gathered_bytes == {"weight": 10.0}
    assert qlora.state_terms() == {"quantized": (16, 8.0)}


def _key_readers(key: str) -> list[str]:
    """The package modules whose code reads ``key``'s field as an attribute (``cfg.parallel.prefetch``,
    ``p.prefetch``; a name that is also a method elsewhere, ``compile``, only after its section)."""
    *sections, name = key.split(".")
    out = set()
    for path in (REPO / "fsdp_zero").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == name:
                inner = getattr(node.value, "attr", getattr(node.value, "id", None))
                if name not in ("compile", "quantize") or inner == sections[-1]:
                    out.add(path.relative_to(REPO / "fsdp_zero").as_posix())
    return sorted(out)


@pytest.mark.parametrize(
    "lever",
    [row for row in LEVERS if row.keys[0] not in {f"parallel.{a.name}_size" for a in GRID}],
    ids=lambda row: row.name,
)
def test_no_fourth_module_reads_a_levers_key(lever):
    """docs/architecture.md's recipe for a new lever: its key is read where it is refused
    (config/rules.py), where its mechanism acts and where a printout needs it, three modules at most;
    the build, the trainer, the formulas and the planner ask its row (`Lever.value`, its facets).
    (Parallel dimensions are asked by axis name: tests/test_topology.py.)"""
    readers = _key_readers(lever.keys[0])
    assert len(readers) <= 3, f"{lever.keys[0]} is read in {readers}: ask the {lever.name} row"
