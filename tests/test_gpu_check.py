"""bench/gpu_check.py (`make gpu-check`'s benchmark) without a GPU: its dry run, and its refusal.

The dry run takes the GPU check's own steps on the CPU with gpt_nano (four settings, each a fresh
`scripts/train.py` run; the planner for each; the worker that builds the model and times the
hand-written loop against ours), so the suite checks every part of the benchmark but the CUDA
calls. Without --dry-run and without a GPU it must say so in one line before doing anything.

Covers: fsdp_zero/tools/launch.py
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from tests.conftest import REPO, check, figure, run_script

GPU_CHECK = REPO / "bench" / "gpu_check.py"
SETTINGS = [
    "fp32",
    "bf16-mixed",
    "fp32 + activation checkpointing (full)",
    "fp32 + CPU offload",
    "fp32 + optimizer states on the host",
    "fp32 + half the optimizer states on the host",
]
LOOPS = ["hand-written fully_shard loop (median of 3)", "ours, the same process (median of 3)"]
PLANNER_TOLERANCE = 0.2  # the planner's CPU peaks have held within 10% (docs/compare-and-plan.md)


def _tables(markdown: str) -> dict[str, list[dict[str, str]]]:
    """Each `### heading`'s first markdown table, as rows keyed by its header cells (the first column
    keeps its own name; repeated header names get a numeric suffix)."""
    tables: dict[str, list[dict[str, str]]] = {}
    heading, head = None, None
    for line in markdown.splitlines():
        if line.startswith("### "):
            heading, head = line[4:], None
        elif line.startswith("|") and heading and not line.startswith("|---"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if head is None:
                head = [f"{c}{i}" if cells.index(c) != i else c for i, c in enumerate(cells)]
                tables[heading] = []
            else:
                tables[heading].append(dict(zip(head, cells)))
    return tables


def _number(cell: str) -> float:
    return float(cell.replace(",", "").split()[0].rstrip("%"))


def test_dry_run_prints_every_figure_of_the_gpu_check(tmp_path: Path):
    """One markdown block on stdout with every row the GPU check prints, CPU figures in it (its main in this
    process: the runs and the worker are processes of their own, as on a GPU)."""
    out = tmp_path / "out"
    proc = check(run_script(GPU_CHECK, "--dry-run", "--peak-tflops", "0.05", "--out", str(out)))
    assert "Traceback" not in proc.stderr, proc.stderr
    text = proc.stdout.strip()
    assert text.startswith("## GPU check: CPU (dry run)") and "error:" not in text, text[:500]
    tables = _tables(text)

    memory = {
        row["setting"]: row for row in tables["Memory per rank (MiB) and the planner's peak RSS"]
    }
    assert list(memory) == SETTINGS
    for name, row in memory.items():
        assert row["ranks"] == "1" and row["rank"] == "0", row
        peak, planned = _number(row["peak RSS"]), _number(row["planner's peak"])
        assert peak > 0 and planned > 0, row
        assert _number(row["measured / planned"]) == pytest.approx(peak / planned, abs=2e-3), row
        assert abs(peak / planned - 1) < PLANNER_TOLERANCE, (name, peak, planned)

    first = {
        row["setting"]: row
        for row in tables[next(t for t in tables if t.startswith("The first step"))]
    }
    assert list(first) == SETTINGS
    # fp32 model state after build, backward, optimizer step: 4, 8, 16 bytes a parameter; with
    # AdamW's moments on the host 8 after the step; with the last half of its 9 step groups' on the
    # host, the rest's (made at the build, for a checkpoint to load into) about 4 of them
    weights = _number(first["fp32"]["model state: built"])
    for name, row in first.items():
        built, backward, stepped = (
            _number(row[k]) for k in ("model state: built", "backward", "optimizer step")
        )
        if name == "fp32 + half the optimizer states on the host":
            assert 2.6 * weights < stepped == backward < 3.4 * weights, row
            assert built == pytest.approx(stepped - weights, rel=0.05), row
            continue
        assert built == pytest.approx(weights, rel=0.05), row
        assert backward == pytest.approx(2 * built, rel=0.05), row
        moments = 0 if name == "fp32 + optimizer states on the host" else 2
        assert stepped == pytest.approx((2 + moments) * built, rel=0.05), row

    speed = {row["run"]: row for row in tables["Throughput"]}
    assert list(speed) == SETTINGS + LOOPS
    for name, row in speed.items():
        tokens = _number(row["tokens/s"])
        assert tokens > 0 and math.isfinite(tokens), row
        assert re.fullmatch(r"[\d.]+% of 0\.05", row["MFU % of peak TFLOP/s"]), row

    loop = tables[next(t for t in tables if t.startswith("Ours against a minimal hand-written"))]
    assert [row["repeat"] for row in loop] == ["0", "1", "2"]
    assert all(
        _number(row["hand-written s/step"]) > 0 and _number(row["ours s/step"]) > 0 for row in loop
    )
    ratio = re.search(r"median ours / hand-written step time: ([\d.]+)", text)
    assert ratio and float(ratio.group(1)) > 0

    assert re.search(r"skipped: the 2-rank NCCL comparison .* needs 2 GPUs", text)
    assert "torch.cuda.memory_summary() is CUDA-only" in text
    assert "```" not in text  # no memory_summary blocks on the CPU
    for log in out.glob("*.log"):  # no run of a dry run saw a GPU
        assert "device cuda" not in log.read_text(), log
    ratios = ", ".join(row["measured / planned"] for row in memory.values())
    figure(
        "bench/gpu_check.py --dry-run (gpt_nano, CPU): peak RSS / the planner's, per setting",
        ratios,
    )


def test_without_a_gpu_it_asks_for_one_or_for_the_dry_run(tmp_path: Path):
    proc = run_script(GPU_CHECK, "--out", str(tmp_path / "out"))  # this process sees no GPU
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert (
        len(lines) == 1
        and lines[0].startswith("error: ")
        and "GPU" in lines[0]
        and "--dry-run" in lines[0]
    ), lines
    assert proc.stdout == ""
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_a_bad_peak_is_one_line_and_exit_2():
    for bad in ("0", "989,67,1", "fast", "-1,2"):  # refused before any run or CUDA call
        proc = run_script(GPU_CHECK, "--dry-run", f"--peak-tflops={bad}")
        err = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(err) == 1, proc.stderr
        assert err[0].startswith(f"error: --peak-tflops={bad}: expected BF16[,FP32]"), err
