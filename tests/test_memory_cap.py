"""A model that does not fit one rank trains sharded: the meta-device path under an OS-enforced cap.

Each rank's data segment (heap and anonymous mappings: every CPU tensor) is capped with
RLIMIT_DATA at 2.4 GB, less than the 2.56 GB that 16 bytes x 160M parameters of fp32 AdamW state
take. Single-process training cannot allocate it; FULL_SHARD over 4 ranks holds 16 P / 4 per rank
and takes an optimizer step (the step that allocates the AdamW states: model state at its full
16 P / N). About 30 s on 2 cores: 4 ranks of a 160M-parameter model.

Covers: fsdp_zero/sharding/build.py, fsdp_zero/model/construct.py
"""

from __future__ import annotations

import pytest

from fsdp_zero.config.loader import load_config
from fsdp_zero.model.transformer import _args_from_config
from tests.conftest import REPO, TRAIN, figure, launch

CAPPED = REPO / "tests" / "workers" / "capped.py"
CAP = 2_400_000_000
MODEL = [
    "model.preset=gpt_tiny",
    "model.dim=1024",
    "model.n_layers=10",
    "model.n_heads=16",
    "model.vocab_size=16384",
    "data.seq_len=32",
    "train.global_batch_size=4",
    "train.micro_batch_size=1",
    "train.steps=1",
    "train.log_every=1",
    "checkpoint.enabled=false",
    "memory.profile_step=0",
    "metrics.tensorboard=false",
]


@pytest.mark.slow
def test_a_model_larger_than_one_ranks_cap_trains_sharded_over_four(tmp_path):
    num_params = _args_from_config(load_config(None, MODEL).model).num_params()
    assert 16 * num_params > CAP  # fp32 AdamW state alone exceeds one rank's memory
    env = {"FSDP_ZERO_DATA_CAP": str(CAP)}
    single = launch(0, CAPPED, str(TRAIN), *MODEL, f"run.root={tmp_path}", "run.name=one", env=env)
    assert single.returncode != 0 and "can't allocate memory" in single.stderr
    sharded = launch(
        4,
        CAPPED,
        str(TRAIN),
        *MODEL,
        f"run.root={tmp_path}",
        "run.name=four",
        env=env,
        torchrun=False,
    )
    assert sharded.returncode == 0, sharded.stderr[-3000:]
    assert "step     1 | loss" in sharded.stdout + sharded.stderr
    # 16 P / 4
    assert (
        "memory after_optimizer_step  model state   610.58 MiB/rank"
        in sharded.stdout + sharded.stderr
    )
    figure(
        "memory cap (RLIMIT_DATA 2.4 GB per rank), 160M params: 1 rank fails, 4 ranks train",
        f"16 B x P = {16 * num_params / 1e9:.2f} GB; model state per rank at N=4 {4 * num_params / 1e9:.2f} GB",
    )
