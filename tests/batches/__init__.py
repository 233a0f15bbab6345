"""The suite's training runs, batched: one launch per world size runs every configuration that needs it.

A process start costs 3-6 s of a 2-core machine, a gpt_nano configuration about 2 s, so the
runs that the tests only read (parity, checkpoints, moves between strategies, foreign models) are
declared here and run by `tests/workers/jobs.py`, several per launch, in sequence and each from
scratch (its own model, optimizer, data and run directory). A launch runs when a test first asks
for one of its runs, after the launches it reads checkpoints from; the runs of a launch that no
collected test module reads are left out, so a single test file launches only what it needs.

Resumes are in launches of their own (``2-resume``, and the 1- and 4-rank ones that continue
2-rank checkpoints): a resume shows that a checkpoint carries the state only in a process that
never held it.

The runs are declared by world size in runs_2.py (launches "2" and "2-resume") and runs_1_3_4.py,
from the overrides in settings.py; launches.py holds the launches and the files each makes first.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import torch

from fsdp_zero.config.loader import load_config
from tests.batches.launches import LAUNCHES, _qlora_bases
from tests.batches.runs_1_3_4 import RUNS_1_3_4
from tests.batches.runs_2 import RUNS_2
from tests.batches.runs_experts import RUNS_EXPERTS
from tests.batches.settings import (  # what test modules import from tests.batches, as before
    ADAMW8_4,
    BASE,
    BF16,
    BLOCK_LINEARS,
    COMMON,
    DS_CONTINUED,
    DS_RUNS,
    EVAL,
    EVAL_TOKENS,
    FF_UNITS,
    FOUR_LAYERS,
    FP8_4,
    FREEZE,
    GROUPED,
    HAS_HF,
    HSDP_MB1,
    LLAMA,
    LORA,
    LOW_BIT,
    MASKED,
    MASKED_TOKENS,
    PP2,
    PROFILED,
    QLORA,
    QLORA_4,
    QLORA_BASE_SEED,
    SPLIT,
    TIED,
    TP2,
    UNTIED_EVEN,
    VIT,
    WORKER,
    B,
    C,
    E,
    F,
    K,
    L,
    Launch,
    M,
    P,
    Q,
    Run,
    S,
    T,
    ds_continued_runs,
    ds_settings,
)
from tests.conftest import REPO, check, launch

__all__ = [
    "ADAMW8_4",
    "B",
    "BASE",
    "BF16",
    "BLOCK_LINEARS",
    "BY_NAME",
    "Batches",
    "C",
    "COMMON",
    "DS_CONTINUED",
    "DS_RUNS",
    "E",
    "EVAL",
    "EVAL_TOKENS",
    "F",
    "FF_UNITS",
    "FOUR_LAYERS",
    "FP8_4",
    "FREEZE",
    "GROUPED",
    "HAS_HF",
    "HSDP_MB1",
    "K",
    "L",
    "LAUNCHES",
    "LLAMA",
    "LORA",
    "LOW_BIT",
    "Launch",
    "M",
    "MASKED",
    "MASKED_TOKENS",
    "P",
    "PP2",
    "PROFILED",
    "Q",
    "QLORA",
    "QLORA_4",
    "QLORA_BASE_SEED",
    "RUNS",
    "Run",
    "S",
    "SPLIT",
    "T",
    "TIED",
    "TP2",
    "UNTIED_EVEN",
    "VIT",
    "WORKER",
    "_qlora_bases",
    "ds_continued_runs",
    "ds_settings",
    "run_config",
]

RUNS: list[Run] = [*RUNS_2, *RUNS_1_3_4, *RUNS_EXPERTS]
BY_NAME = {run.name: run for run in RUNS}
assert len(BY_NAME) == len(RUNS)


def run_config(name: str):  # noqa: ANN201 - a fsdp_zero Config
    """The config of run ``name`` (its ``--config`` file, from the repository root, under its overrides)."""
    args = BY_NAME[name].args
    path, extra = (args[1], list(args[2:])) if args[:1] == ("--config",) else (None, list(args))
    return load_config(path and str(REPO / path), extra)


class Batches:
    """Runs each launch once per session, when one of its runs is first asked for."""

    def __init__(self, root: Path, modules: set[str]) -> None:
        self.root = root
        self.modules = modules  # the collected test modules (file stems): whose runs to include
        self.done: set[str] = set()
        self.failed: dict[str, str] = {}  # launch -> why, for every test that reads one of its runs

    def __getitem__(self, name: str) -> dict:
        run = BY_NAME[name]
        self._launch(run.launch)
        return torch.load(self.root / f"{name}.pt", weights_only=True)

    def path(self, name: str) -> Path:
        """The run directory of ``name`` (its launch has run)."""
        self[name]
        return self.root / (BY_NAME[name].run_name or name)

    def _launch(self, key: str) -> None:
        if key in self.failed:
            raise AssertionError(
                f"launch {key!r} failed earlier in this session:\n{self.failed[key]}"
            )
        if key in self.done:
            return
        spec = LAUNCHES[key]
        for before in spec.after:
            self._launch(before)
        if spec.prepare:
            spec.prepare(self.root)
        jobs = [
            [
                str(self.root / f"{r.name}.pt"),
                r.job_args(self.root),
                r.options,
            ]
            for r in RUNS
            if r.launch == key
            and set(r.readers) & self.modules
            and (
                HAS_HF
                or not any(
                    a.startswith(("model.target=transformers:", "model.pretrained="))
                    for a in r.args
                )
            )
        ]
        if not jobs:  # no collected module reads this launch's runs (only a later launch's)
            self.done.add(key)
            return
        spec_file = self.root / f"launch-{key}.json"
        spec_file.write_text(json.dumps(jobs, indent=1))
        try:
            check(launch(spec.nproc, WORKER, "--jobs", str(spec_file), torchrun=False, timeout=600))
        except (AssertionError, subprocess.TimeoutExpired) as e:
            self.failed[key] = str(e)[-6000:]
            raise
        self.done.add(key)
