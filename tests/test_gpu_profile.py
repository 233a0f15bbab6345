"""bench/gpu_profile.py (issue 46's GPU profile) without a GPU: its dry run, so that a typo never
costs device time, and its refusals.

The dry run takes every part on the CPU with gpt_nano: the environment, the ceilings, the trainer
variants A-F (A with the documented data inside the step; A and F traced through
metrics.trace_steps and summarized by fsdp_zero.monitor.trace), the hand-written FSDP2 loop and the
no-FSDP ceiling, each written to results.jsonl as it ends, then the table.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import REPO, check, run_script

PROFILE = REPO / "bench" / "gpu_profile.py"


def test_the_dry_run_runs_every_part_and_writes_each_as_it_ends(tmp_path: Path):
    out = tmp_path / "gp"
    proc = check(run_script(PROFILE, "--out", str(out), "--dry-run", "--steps", "4"))
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [r["part"] for r in rows] == ["env", "ceilings", "A", "B", "C", "D", "E", "F", "G", "H"]
    ceilings = rows[1]
    assert ceilings["gemm_output_tflops"] > 0 and ceilings["copy_gb_per_s"] > 0
    for row in rows[2:]:
        assert row["step_s"] > 0 and row["tokens_per_s"] > 0, row
    # A's data is the documented in-step source: its steps read old-source batches (the same bits)
    for name in ("A", "F"):
        summary = next(r for r in rows if r["part"] == name)["trace_summary"]
        assert Path(next(r for r in rows if r["part"] == name)["trace"]).exists()
        assert any(k.startswith("FSDP::pre_forward") for k in summary["fsdp"]), summary["fsdp"]
    table = (out / "table.md").read_text()
    assert table == proc.stdout[-len(table) :]
    assert [line.split("|")[1].strip() for line in table.splitlines()[2:]] == list("ABCDEFGH")


def test_without_a_gpu_it_asks_for_one_and_bad_parts_are_named(tmp_path: Path):
    proc = run_script(PROFILE, "--out", str(tmp_path))  # this process sees no GPU
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "error: no CUDA GPU is visible; --dry-run runs the same parts on the CPU"
    ]
    proc = run_script(PROFILE, "--out", str(tmp_path), "--dry-run", "--parts", "A,Z")
    assert (
        proc.returncode == 2
        and "--parts: 'Z' is not a part; valid: env, ceilings, A" in proc.stderr
    )
    assert not any(tmp_path.iterdir())  # nothing written
