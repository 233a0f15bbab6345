"""scripts/compare.py at 4 ranks: the DDP vs ZeRO-1/2/3 lesson, with its table, chart and curves."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.conftest import REPO, check, launch

COMPARE = REPO / "scripts" / "compare.py"


PLAN = REPO / "scripts" / "plan.py"
CONFIG = ["model.preset=gpt_tiny", "train.global_batch_size=16", "train.steps=4", "train.log_every=2"]


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"n{n}")
def compared(request, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("cmp") / f"out{request.param}"
    check(launch(request.param, COMPARE, "--out", str(out), *CONFIG))
    return out


def rows(md: str) -> dict[str, list[str]]:
    out = {}
    for line in md.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 11 and cells[0] in ("ddp", "zero1", "shard_grad_op", "full_shard"):
            out[cells[0]] = cells
    return out


def num(text: str) -> float:
    return float(text.replace(",", ""))


def test_table_orders_memory_ddp_zero1_zero2_zero3_at_4_ranks(compared: Path):
    table = rows((compared / "compare.md").read_text())
    assert list(table) == ["ddp", "zero1", "shard_grad_op", "full_shard"]
    state = {k: num(v[4]) for k, v in table.items()}
    formula = {k: num(v[5]) for k, v in table.items()}
    for k in state:  # model state follows the ZeRO formula within 2%
        assert state[k] == pytest.approx(formula[k], rel=0.02), k
    assert state["ddp"] > state["zero1"] > state["shard_grad_op"] == state["full_shard"]
    tracked = {k: num(v[7]) for k, v in table.items()}  # tensor bytes at the step's peak
    assert tracked["ddp"] > tracked["zero1"] > tracked["shard_grad_op"] >= tracked["full_shard"]
    # Peak RSS: at 1M parameters the libraries (~800 MiB) dwarf the model, so only "not above DDP"
    # is asserted here; the benchmark in the README shows the gap on a 134M model.
    peak_rss = {k: num(v[2]) for k, v in table.items()}
    assert peak_rss["full_shard"] <= peak_rss["ddp"] * 1.01
    # ZeRO-2 keeps every unit's parameters gathered from forward to backward; ZeRO-3 one unit at a time.
    assert num(table["shard_grad_op"][6]) > num(table["full_shard"][6]) > 0 == num(table["ddp"][6])
    losses = {v[10] for v in table.values()}
    assert len(losses) == 1, losses  # the same training, whatever the strategy


def test_chart_is_a_readable_png(compared: Path):
    import matplotlib.image

    image = matplotlib.image.imread(compared / "compare.png")
    assert image.shape[0] > 400 and image.shape[1] > 1000
    assert image[..., :3].std() > 0.1  # not blank


def test_tensorboard_holds_the_breakdown(compared: Path):
    acc = EventAccumulator(str(compared / "tb" / "compare"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert {"compare_ddp/peak_rss_mib", "compare_full_shard/gathered_params_mib", "compare_zero1/optimizer_mib"} <= set(tags)
    n = int(compared.name[3:])
    assert [e.step for e in acc.Scalars("compare_ddp/peak_rss_mib")] == list(range(n))  # x = rank
    run = EventAccumulator(str(compared / "full_shard" / "tb" / f"rank{n - 1}"))
    run.Reload()
    scalars = run.Tags()["scalars"]
    assert {f"memory_breakdown/{c}_mib" for c in ("params", "gathered_params", "grads", "optimizer", "activations",
                                                 "comm_buffers", "other")} <= set(scalars)
    assert [e.step for e in run.Scalars("memory_within_step/total_mib")] == [0, 1, 2, 3]
    assert re.search(r"\d", (compared / "compare.md").read_text())


def test_planner_predicts_the_measured_peak_within_10_percent(compared: Path, tmp_path: Path):
    """scripts/plan.py simulates one rank (fake tensors, fake process group) before any run."""
    n = int(compared.name[3:])
    out = tmp_path / "plan.json"
    proc = check(launch(0, PLAN, "--world-size", str(n), "--json", str(out), "--device-memory", "24GB", *CONFIG))
    assert "ZeRO paper" in proc.stdout and "DeepSpeed estimate_zero3_model_states_mem_needs" in proc.stdout
    predicted = {p["strategy"]: p for p in json.loads(out.read_text())}
    measured = rows((compared / "compare.md").read_text())
    for strategy, cells in measured.items():
        p = predicted[strategy]
        assert p["peak"] / 2**20 == pytest.approx(num(cells[2]), rel=0.10), strategy  # peak RSS per rank
        assert p["model_state"] / 2**20 == pytest.approx(num(cells[4]), rel=0.02), strategy
        assert sum(p["tensors"].values()) / 2**20 == pytest.approx(num(cells[7]), rel=0.15), strategy


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available() or __import__("torch").cuda.device_count() < 2,
                    reason="needs 2 or more GPUs in one process")
def test_dataparallel_row_with_several_gpus_in_one_process(tmp_path: Path):
    out = tmp_path / "dp"
    check(launch(0, COMPARE, "--out", str(out), *CONFIG))
    md = (out / "compare.md").read_text()
    assert "| dataparallel (1 process," in md and "(GPU)" in md


def test_planner_plans_for_gpus_from_a_machine_without_one(tmp_path: Path):
    out = tmp_path / "gpu.json"
    proc = check(launch(0, PLAN, "--world-size", "8", "--json", str(out), "--device-memory", "80GB",
                        "model.preset=gpt_nano", "train.global_batch_size=16", "train.micro_batch_size=2",
                        "data.seq_len=32", "dist.device=cuda"))
    assert "device memory MiB" in proc.stdout and "fits" in proc.stdout
    for p in json.loads(out.read_text()):
        assert p["baseline"] == 0 and p["peak"] > sum(p["tensors"].values()) > 0, p["strategy"]
