"""scripts/compare.py and scripts/plan.py on a model whose memory is mostly its own.

At 46M parameters (4 layers of d 512, vocabulary 32768, short sequences, gradient
accumulation of 2 at 2 ranks) model state and activations are of the order of the ~720 MiB
a rank holds for the PyTorch libraries (more under DDP, ~80% of it under ZeRO-3), so the
comparison's ordering shows in peak RSS and the planner's prediction of the model-dependent
memory can be told apart from the baseline. The planner's heap-retention constants were fitted on a
GPT-2-small-shaped model
(`bench/planner_accuracy.py`, configuration `fit`): this configuration is held out.

Covers: fsdp_zero/tools/compare.py, fsdp_zero/tools/planner.py, fsdp_zero/tools/prediction.py,
    fsdp_zero/tools/launch.py, fsdp_zero/training/summary.py
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from fsdp_zero.config.presets import model_args
from fsdp_zero.monitor import MIB
from fsdp_zero.tools.fit import FIT_MARGIN
from fsdp_zero.tools.prediction import HEAP_RETENTION
from fsdp_zero.training.summary import Summary
from tests.conftest import REPO, check, figure, launch, run_script, start, visible_gpus

COMPARE = REPO / "scripts" / "compare.py"
PLAN = REPO / "scripts" / "plan.py"
STRATEGIES = ["ddp", "zero1", "shard_grad_op", "full_shard"]
FSDP = ("shard_grad_op", "full_shard")
# wide and shallow, a big vocabulary, short sequences (bench/planner_accuracy.py's "wide")
CONFIG = (
    "model.preset=gpt_small model.dim=512 model.n_layers=4 model.n_heads=8 model.vocab_size=32768 "
    "data.seq_len=64 train.global_batch_size=4 train.micro_batch_size=1"
).split()
# Tensors by category from step 2, whose forward is where DDP rebuilds its gradient buckets, so
# that the tracker sees them whole; peak RSS from steps 1 and 3 (the profiled step's tracker
# holds bookkeeping of its own, which is not the model's).
RUN = ["train.steps=3", "train.log_every=1", "memory.profile_step=2"]
N = 2
# The model-dependent memory, (peak RSS - baseline), against the planner's tensors x (1 + slack).
# full_shard's measured term moves with what glibc keeps of gloo's FSDP buffers: -1.4% to -12.5% over
# five runs of the suite on 2 cores; a planner whose tensors are halved misses by about 45%.
TERM_TOLERANCE = 0.15


@pytest.fixture(scope="module")
def compared(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Path:
    """compare.py's four runs; the planner's fixtures (plan.py in this process, one core) run while they train."""
    out = tmp_path_factory.mktemp("cmp") / "out"
    finished = start(0, COMPARE, "--nproc-per-node", str(N), "--out", str(out), *CONFIG, *RUN)
    try:
        request.getfixturevalue("fitted")  # and `predicted`, which it reads
    finally:
        check(finished())
    return out


@pytest.fixture(scope="module")
def measured(compared: Path) -> dict[str, list[dict]]:
    rows = json.loads((compared / "compare.json").read_text())
    assert list(rows) == ["full_shard", "shard_grad_op", "zero1", "ddp"]  # the order they ran in
    assert all(len(ranks) == N for ranks in rows.values())
    return rows


@pytest.fixture(scope="module")
def predicted(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, dict], str]:
    out = tmp_path_factory.mktemp("plan") / "plan.json"
    proc = check(
        run_script(
            PLAN,
            "simulate",
            *("--world-size", str(N), "--json", str(out), "--device-memory", "24GB", *CONFIG),
        )
    )
    return {p["strategy"]: p for p in json.loads(out.read_text())}, proc.stdout


def table_rows(md: str) -> dict[str, list[str]]:
    out = {}
    for line in md.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 11 and cells[0] in STRATEGIES:
            out[cells[0]] = cells
    return out


def num(text: str) -> float:
    return float(text.replace(",", ""))


def peak_mib(ranks: list[dict]) -> float:
    return max(r["peak_rss_mib"] for r in ranks)


def test_table_orders_the_strategies_by_memory(compared: Path, measured):
    table = table_rows((compared / "compare.md").read_text())
    assert list(table) == STRATEGIES  # DDP first, as in the lesson
    for s, cells in table.items():  # the table shows the measured rows
        assert num(cells[2]) == pytest.approx(peak_mib(measured[s]), abs=0.5), s
        assert num(cells[4]) == pytest.approx(
            max(r["model_state"] for r in measured[s]) / MIB, abs=0.05
        ), s
    state = {k: num(v[4]) for k, v in table.items()}
    formula = {k: num(v[5]) for k, v in table.items()}
    for k in state:  # model state follows each strategy's ZeRO formula within 2%
        assert state[k] == pytest.approx(formula[k], rel=0.02), k
    assert state["ddp"] > state["zero1"] > state["shard_grad_op"] == state["full_shard"]
    tracked = {k: num(v[7]) for k, v in table.items()}  # tensor bytes at the profiled step's peak
    assert tracked["ddp"] > tracked["zero1"] > tracked["shard_grad_op"] > tracked["full_shard"]
    # Gathered parameters after the first forward, a fixed phase (the step's peak has two near-equal
    # moments under ZeRO-3, and which wins varies from run to run): ZeRO-2 keeps every unit gathered from
    # forward to its backward (4 P bytes), ZeRO-3 only the root (a norm: under 1 KiB) and the last unit,
    # whose backward comes next (the head, 32,768 x 512), DDP and ZeRO-1 gather nothing.
    gathered = {k: num(v[6]) for k, v in table.items()}
    full = 4 * measured["ddp"][0]["num_params"] / MIB
    assert gathered["shard_grad_op"] == pytest.approx(full, abs=0.05)
    assert gathered["full_shard"] == pytest.approx(4 * 32768 * 512 / MIB, abs=0.05)
    assert gathered["ddp"] == gathered["zero1"] == 0
    # What a user sees: DDP's peak RSS is the highest and ZeRO-3's the lowest.
    peak = {k: num(v[2]) for k, v in table.items()}
    assert peak["ddp"] == max(peak.values()) and peak["full_shard"] == min(peak.values())
    assert peak["full_shard"] < 0.95 * peak["ddp"]
    losses = {v[10] for v in table.values()}
    assert len(losses) == 1, losses  # the same training, whatever the strategy


def test_chart_is_a_readable_png(compared: Path):
    import matplotlib.image

    image = matplotlib.image.imread(compared / "compare.png")
    assert image.shape[0] > 400 and image.shape[1] > 1000
    assert image[..., :3].std() > 0.1  # not blank


def test_tensorboard_holds_the_figures_of_the_table(compared: Path, measured):
    acc = EventAccumulator(str(compared / "tb" / "compare"))
    acc.Reload()
    for s in STRATEGIES:
        peaks = acc.Scalars(f"compare_{s}/peak_rss_mib")
        assert [e.step for e in peaks] == list(range(N))  # x = rank
        for e in peaks:
            assert e.value == pytest.approx(measured[s][e.step]["peak_rss_mib"], abs=0.01), (
                s,
                e.step,
            )
        optimizer = acc.Scalars(f"compare_{s}/optimizer_mib")
        for e in optimizer:
            assert e.value == pytest.approx(
                measured[s][e.step]["breakdown"]["optimizer"] / MIB, abs=0.01
            ), (s, e.step)
    run = EventAccumulator(str(compared / "full_shard" / "tb" / f"rank{N - 1}"))
    run.Reload()
    scalars = run.Tags()["scalars"]
    assert {
        f"memory_breakdown/{c}_mib"
        for c in ("params", "gathered_params", "grads", "optimizer", "activations")
        + ("comm_buffers", "other")
    } <= set(scalars)
    assert [e.step for e in run.Scalars("memory_within_step/total_mib")] == [0, 1, 2, 3]


def _error(predicted_term: float, measured_term: float) -> float:
    return predicted_term / measured_term - 1


def test_planner_predicts_the_model_dependent_memory(measured, predicted):
    """(peak RSS - baseline) against the planner's tensors + heap retention, strategy by strategy; and
    the same comparison catches a planner whose simulated tensors are halved. (This model's heap keeps
    little: the retention term is 1-5% of the memory here, so a planner without it would pass too; on
    bench/planner_accuracy.py's `deep` it is 20-45%, and leaving it out misses by that much.)"""
    preds, stdout = predicted
    assert "ZeRO paper" in stdout and "DeepSpeed estimate_zero3_model_states_mem_needs" in stdout
    assert set(preds) == set(measured) == set(STRATEGIES)
    errors, without_retention = {}, {}
    for s in STRATEGIES:
        p, peak = preds[s], peak_mib(measured[s]) * MIB
        # The PyTorch runtime, measured by a probe process: hundreds of MiB, below any real run's peak.
        assert 200 * MIB < p["baseline"] < min(peak_mib(ranks) for ranks in measured.values()) * MIB
        term = peak - p["baseline"]
        # the model's memory is of the baseline's order, by construction
        assert term > 0.75 * p["baseline"]
        tensors = sum(p["tensors"].values())
        retained = HEAP_RETENTION["activations"] * p["heap_activations"]
        retained += HEAP_RETENTION["fsdp"] * p["heap_at_peak"] if s in FSDP else 0
        assert p["peak"] - p["baseline"] == pytest.approx(tensors + retained, abs=1)
        errors[s] = _error(p["peak"] - p["baseline"], term)
        assert abs(errors[s]) <= TERM_TOLERANCE, f"{s}: {errors[s]:+.1%}"
        assert p["peak"] == pytest.approx(peak, rel=0.10), s  # the whole peak, baseline included
        without_retention[s] = _error(tensors, term)
        # A planner that simulated half the tensors fails, whatever it adds on top.
        assert abs(_error(tensors / 2 + retained, term)) > TERM_TOLERANCE, s
        # Model state after an optimizer step, simulated against measured.
        assert p["model_state"] == pytest.approx(
            max(r["model_state"] for r in measured[s]), rel=0.01
        ), s
    figure(
        f"planner vs measured, held-out 46M model, N={N}: (peak - baseline) vs predicted",
        ", ".join(f"{s} {e:+.1%}" for s, e in errors.items())
        + " (without heap retention: "
        + ", ".join(f"{e:+.1%}" for e in without_retention.values())
        + ")",
    )


def test_simulated_tensors_match_the_tracker(measured, predicted):
    """The simulation runs the real step on fake tensors and sees what the tracker sees in a real run: under
    FSDP category by category at the step's fixed phases (after the first forward, the backward and the
    optimizer step), to the MiB; under DDP and ZeRO-1 the total at the step's peak to 1% (the real tracker
    files the gradient buckets DDP rebuilds in step 2's forward as activations; the simulation, as
    gradients). An FSDP run's tracked peak is not a fixed moment: gloo frees the buffers of its
    asynchronous collectives when their work objects go, so a real run's peak holds, besides the simulated
    moment, whatever of them is still alive then (measured +1.6% and +5.2% over the simulation on ZeRO-3,
    in two suite runs): it is held between the simulation's peak and 8% above it."""
    preds, _ = predicted
    for s in STRATEGIES:
        tracked = max(sum(r["breakdown"].values()) for r in measured[s])
        simulated = sum(preds[s]["tensors"].values())
        if s not in FSDP:
            assert simulated == pytest.approx(tracked, rel=0.01), s
            continue
        assert 0.99 * simulated <= tracked <= 1.08 * simulated, (s, tracked, simulated)
        for phase in ("after_forward", "after_backward", "after_optimizer_step"):
            for cat, value in preds[s]["phases"][phase].items():
                real = measured[s][0]["phases"][phase][cat]
                assert value == pytest.approx(real, abs=MIB), (s, phase, cat)


def test_the_plan_prints_the_bytes_each_strategys_run_counted(compared: Path, predicted):
    """plan.py's communication table (`fsdp_zero.monitor.comm.comm_formula`, its fp32 rows) against the bytes
    each strategy's run counted from its collectives in its last step (summary.json)."""
    _, stdout = predicted
    printed = {}
    for line in stdout.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 6 and cells[0] in STRATEGIES and cells[1] == "fp32":
            printed[cells[0]] = dict(
                zip(("all_gather", "reduce_scatter", "all_reduce"), map(num, cells[2:5]))
            )
    assert set(printed) == set(STRATEGIES)
    for s, kinds in printed.items():
        counted = json.loads((compared / s / "summary.json").read_text())["ranks"][0]["comm_bytes"]
        for kind, mib in kinds.items():
            assert mib == pytest.approx(counted[kind] / MIB, abs=0.05), (s, kind)
    assert (
        printed["full_shard"]["all_gather"]
        > printed["shard_grad_op"]["all_gather"]
        > 0
        == printed["ddp"]["all_gather"]
    )


@pytest.fixture(scope="module")
def fitted(tmp_path_factory: pytest.TempPathFactory, predicted) -> tuple[int, dict]:
    """plan.py fit over the strategies, with a budget between ZeRO-1's predicted peak and ZeRO-2's and no
    margin (the default 10% is checked from the same JSON)."""
    preds, _ = predicted
    budget = (preds["zero1"]["peak"] + preds["shard_grad_op"]["peak"]) // 2 // MIB * MIB
    out = tmp_path_factory.mktemp("fit") / "fit.json"
    proc = check(
        run_script(
            PLAN,
            "fit",
            "--world-size",
            str(N),
            "--device-memory",
            f"{budget // MIB}MiB",
            "--search",
            "strategy",
            "--margin",
            "0",
            "--json",
            str(out),
            *CONFIG,
        )
    )
    # On a CPU the rates are measured on this machine, and the plan says so before it searches.
    assert (
        f"rates: measured on this machine by a probe ({N} ranks x 1 thread(s)"
        in proc.stdout.split("candidates")[0]
    )
    assert "pick: " in proc.stdout
    return budget, json.loads(out.read_text())


def test_the_fit_pick_run_stays_within_the_budget_and_its_prediction(fitted, measured, predicted):
    """The cheapest strategy predicted to fit is ZeRO-2 (DDP and ZeRO-1 communicate less, but miss the
    budget); its measured peak (compare.py's run of the same config) is within the budget and 10% of the
    prediction, and the cheaper ones the search turned away do exceed the budget when run."""
    budget, found = fitted
    preds, _ = predicted
    pick = found["pick"]
    strategy = next(
        o.split("=")[1] for o in pick["overrides"] if o.startswith("parallel.strategy=")
    )
    assert strategy == "shard_grad_op"
    # the planner's own simulation
    assert pick["peak_bytes"] == pytest.approx(preds[strategy]["peak"], rel=0.01)
    assert peak_mib(measured[strategy]) * MIB <= budget
    assert peak_mib(measured[strategy]) * MIB == pytest.approx(pick["peak_bytes"], rel=0.10)
    ranked = [c for c in found["candidates"]]
    assert [c["cost"] for c in ranked] == sorted(c["cost"] for c in ranked)
    cheaper = ranked[: next(i for i, c in enumerate(ranked) if c["fits"])]
    rejected = {
        next(o.split("=")[1] for o in c["overrides"] if o.startswith("parallel.strategy="))
        for c in cheaper
    }
    assert rejected == {"ddp", "zero1"}
    for s in rejected:
        assert peak_mib(measured[s]) * MIB > budget, s
    # With the default margin the same budget takes a candidate whose peak + 10% fits: ZeRO-3, within it too.
    safe = next(c for c in ranked if c["peak_bytes"] * (1 + FIT_MARGIN) <= budget)
    assert "parallel.strategy=full_shard" in safe["overrides"]
    assert peak_mib(measured["full_shard"]) * MIB <= budget
    figure(
        f"fit pick, 46M model, N={N}, budget {budget / MIB:,.0f} MiB",
        f"{strategy}: predicted {pick['peak_bytes'] / MIB:,.0f} MiB, measured {peak_mib(measured[strategy]):,.0f} "
        "MiB; rejected cheaper: "
        + ", ".join(f"{s} measured {peak_mib(measured[s]):,.0f} MiB" for s in sorted(rejected)),
    )


@pytest.mark.gpu
@pytest.mark.skipif(visible_gpus() < 2, reason="needs 2 or more GPUs in one process")
def test_dataparallel_row_with_several_gpus_in_one_process(tmp_path: Path):
    out = tmp_path / "dp"
    check(
        launch(
            0,
            COMPARE,
            "--nproc-per-node",
            "1",
            "--out",
            str(out),
            "model.preset=gpt_tiny",
            "train.steps=4",
            gpu=True,
        )
    )
    md = (out / "compare.md").read_text()
    assert "| dataparallel (1 process," in md and "(GPU)" in md


def test_planner_plans_for_gpus_from_a_machine_without_one(tmp_path: Path):
    """dist.device=cuda on a CPU machine: device memory, no process baseline, the formulas still hold."""
    out = tmp_path / "gpu.json"
    args = [
        "simulate",
        "--world-size",
        "8",
        "--json",
        str(out),
        "model.preset=gpt_nano",
        "train.global_batch_size=16",
        "train.micro_batch_size=2",
        "data.seq_len=32",
        "dist.device=cuda",
    ]
    proc = check(run_script(PLAN, *args, "--device-memory", "80GB"))
    assert "device memory MiB" in proc.stdout and "| yes |" in proc.stdout
    preds = {p["strategy"]: p for p in json.loads(out.read_text())}
    assert set(preds) == set(STRATEGIES)
    num_params = model_args("gpt_nano").num_params()
    for s, p in preds.items():
        assert p["baseline"] == 0, s  # device memory holds no libraries
        bytes_per_param = p["model_state"] / num_params
        # AdamW states split by whole tensors: rank 0's share of 8P is uneven at N=8
        if s == "zero1":
            assert 8 < bytes_per_param < 16, s
        else:
            assert bytes_per_param == pytest.approx(16 if s == "ddp" else 16 / 8, rel=0.01), s
    assert preds["ddp"]["peak"] > preds["zero1"]["peak"] > preds["full_shard"]["peak"]
    out.unlink()
    tight = check(run_script(PLAN, *args, "--device-memory", "1MB")).stdout
    assert "| no (needs " in tight


def _rows(n: int) -> dict[str, list[dict]]:
    """Synthetic per-rank rows, as fsdp_zero.tools.compare.read_rows returns them."""
    state = {"ddp": 16, "zero1": 8 + 8 / n, "shard_grad_op": 16 / n, "full_shard": 16 / n}
    rows = {}
    for s, per_param in state.items():
        rows[s] = [
            {
                "strategy": s,
                "num_params": 1_000_000,
                "steps": 6,
                "step_s": 0.5 + 0.1 * (s != "ddp"),
                "final_loss": 4.25,
                "model_state": int(per_param * 1_000_000),
                "peak_rss_mib": 900 + 10 * per_param + r,
                "formula": per_param * 1_000_000,
                "precision": "fp32",
                "peak_reserved_mib": None,
                "breakdown": {
                    "params": 100,
                    "gathered_params": 0,
                    "grads": 100,
                    "optimizer": 200 * MIB,
                    "activations": 50,
                    "comm_buffers": 0,
                    "other": 1,
                },
                # what stays gathered after the forward: ZeRO-2's every unit
                "phases": {"after_forward": {"gathered_params": 4 * MIB * (s == "shard_grad_op")}},
            }
            for r in range(n)
        ]
    return rows


def test_the_report_is_library_code_tested_in_process(tmp_path: Path):
    from fsdp_zero.tools.compare import COMPARE_ORDER, compare_report, read_rows

    md = compare_report(_rows(2), 2, tmp_path)
    table = table_rows(md)
    assert list(table) == STRATEGIES
    assert table["ddp"][3] == "1.00" and num(table["full_shard"][4]) == pytest.approx(
        16 / 2 * 1e6 / MIB, abs=0.05
    )
    # the strategy's formula
    assert num(table["zero1"][5]) == pytest.approx((8 + 8 / 2) * 1e6 / MIB, abs=0.05)
    assert [num(table[k][6]) for k in STRATEGIES] == [0, 0, 4, 0]  # gathered after forward (MiB)
    assert json.loads((tmp_path / "compare.json").read_text()) == _rows(2)
    acc = EventAccumulator(str(tmp_path / "tb" / "compare"))
    acc.Reload()
    assert [e.value for e in acc.Scalars("compare_ddp/optimizer_mib")] == [200.0, 200.0]
    # read_rows: the runs' summary.json files, written as the trainer writes them (Summary), back into rows.
    for s in COMPARE_ORDER:
        (tmp_path / s.value).mkdir()
        ranks = [
            {
                k: r[k]
                for k in ("peak_rss_mib", "peak_reserved_mib", "step_s", "breakdown", "phases")
            }
            | {"model_state_bytes": r["model_state"]}
            for r in _rows(2)[s.value]
        ]
        Summary(
            strategy=s.value,
            precision="fp32",
            steps=6,
            final_loss=4.25,
            num_params=1_000_000,
            num_frozen=0,
            world_size=2,
            model_state_formula_bytes=_rows(2)[s.value][0]["formula"],
            grad_sync="every_micro_batch",
            comm_formula_bytes=None,
            ranks=ranks,
        ).write(tmp_path / s.value)
    assert read_rows(tmp_path) == {s.value: _rows(2)[s.value] for s in COMPARE_ORDER}
    # Without DDP (bf16-mixed, say, which DDP does not run) the ratios are to the first strategy run.
    rows = {k: v for k, v in _rows(2).items() if k not in ("ddp", "zero1")}
    for rs in rows.values():
        for r in rs:
            r["precision"] = "bf16-mixed"
    (tmp_path / "mixed").mkdir()
    md = compare_report(rows, 2, tmp_path / "mixed")
    assert "bf16-mixed AdamW" in md and "| vs shard_grad_op |" in md
    assert (
        list(table_rows(md)) == ["shard_grad_op", "full_shard"]
        and table_rows(md)["shard_grad_op"][3] == "1.00"
    )


def test_compare_refuses_an_existing_folder_and_bad_settings(tmp_path: Path):
    proc = run_script(COMPARE, "--out", str(tmp_path))
    assert proc.returncode == 2 and "already exists; it is never overwritten" in proc.stderr
    proc = run_script(COMPARE, "--out", str(tmp_path / "new"), "train.setps=3")
    assert (
        proc.returncode == 2
        and "did you mean 'train.steps'" in proc.stderr
        and not (tmp_path / "new").exists()
    )


def test_planner_follows_the_precision_and_offload():
    """bf16-true halves the model state the planner predicts (8 bytes per parameter: bf16 weights,
    gradients and AdamW states), within 2% of the formula; under CPU offload all of it is host memory,
    and the device memory predicted for CUDA falls by it."""
    from fsdp_zero.config.loader import load_config
    from fsdp_zero.config.presets import model_args
    from fsdp_zero.config.strategies import Strategy
    from fsdp_zero.tools.planner import simulate
    from fsdp_zero.tools.prediction import CUDA_ALLOCATOR_SLACK

    base = [
        "model.preset=gpt_nano",
        "data.seq_len=32",
        "train.global_batch_size=4",
        "train.micro_batch_size=2",
        "precision=bf16-true",
        "dist.device=cuda",
    ]
    expected = 8 * model_args("gpt_nano").num_params() / 2
    (plain,) = simulate(load_config(None, base), 2, [Strategy.full_shard])
    (offload,) = simulate(
        load_config(None, base + ["parallel.cpu_offload=true"]), 2, [Strategy.full_shard]
    )
    assert plain.model_state == pytest.approx(expected, rel=0.02) and plain.host_state == 0
    assert offload.host_state == pytest.approx(expected, rel=0.02)
    # Device memory without the host-resident state, the allocator's slack on what is left.
    drop = plain.peak - offload.peak
    assert drop == pytest.approx(offload.host_state * (1 + CUDA_ALLOCATOR_SLACK), rel=0.05)


def test_a_bad_size_names_the_option_it_came_from():
    proc = run_script(
        PLAN, "simulate", "--world-size", "2", "--device-memory", "lots", "model.preset=gpt_nano"
    )
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "error: --device-memory 'lots': expected a size such as 2GB, 500MB or 1GiB"
    ), proc.stderr
    # tensor and pipeline layouts come by formula: a strategy's simulation of them is refused
    proc = run_script(
        PLAN, "simulate", "--world-size", "4", "parallel.tp_size=2", "--strategy", "full_shard"
    )
    assert proc.returncode == 2 and proc.stderr.startswith(
        "error: parallel.tp_size/pp_size > 1: plan.py gives their layout by formula"
    ), proc.stderr
    proc = run_script(
        PLAN,
        "layout",
        "--world-size",
        "4",
        "model.preset=gpt_nano",
        "parallel.pp_size=2",
        "parallel.tp_size=2",
    )
    # model state, activations at 1F1B's peak (one micro-batch in flight on the last rank), held
    # in the step, a boundary's bytes
    assert proc.returncode == 0 and "| 1 | 1 | 69,824 | 192 | 0.5342 | 2.8 | 0.2671 | 0.0625 |" in (
        proc.stdout
    ), proc.stdout


def test_fit_searches_the_rest_with_the_configs_tensor_parallel_layout(tmp_path: Path):
    """plan.py fit with parallel.tp_size=2 in the config: every candidate keeps tp 2 (its peak and cost by
    formula), and the pick pastes back to a tp 2 run."""
    out = tmp_path / "fit.json"
    proc = run_script(
        PLAN,
        "fit",
        "--world-size",
        "4",
        "model.preset=gpt_nano",
        "parallel.tp_size=2",
        "--device-memory",
        "2GiB",
        "--search",
        "micro_batch",
        "--tflops",
        "1",
        "--json",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr
    found = json.loads(out.read_text())
    assert len(found["candidates"]) == 4  # micro-batches 1, 2, 4, 8 of dp 2's 8 samples
    assert all("parallel.tp_size=2" in c["overrides"] for c in found["candidates"])
    assert all(c["cost_parts"]["tp_comm_s"] > 0 for c in found["candidates"])
    assert "parallel.tp_size=2 parallel.pp_size=1" in proc.stdout
