"""Model, init, data and memory pieces on their own (single process).

Covers: fsdp_zero/model/transformer.py, fsdp_zero/model/init.py, fsdp_zero/config/presets.py,
    fsdp_zero/data/batches.py, fsdp_zero/data/loader.py, fsdp_zero/training/step.py,
    fsdp_zero/monitor/memory.py, fsdp_zero/training/rundir.py, fsdp_zero/checkpoint/dcp.py,
    fsdp_zero/api.py
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from fsdp_zero.config import RunDir
from fsdp_zero.config.presets import PRESETS, model_args
from fsdp_zero.config.schema import OptimConfig
from fsdp_zero.data.batches import _ByteText, _SyntheticBigram
from fsdp_zero.data.loader import BatchCursor, BatchLayout
from fsdp_zero.model import init
from fsdp_zero.monitor.memory import MemoryMonitor, model_state_bytes
from fsdp_zero.training.step import lr_factor
from tests.conftest import REPO, build_model, check, launch


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_presets_count_their_parameters(preset: str):
    args = PRESETS[preset]
    model = build_model(args)  # meta: no memory even for gpt_1b
    assert sum(p.numel() for p in model.parameters()) == args.num_params()


def test_gpt_1b_has_at_least_a_billion_parameters():
    assert PRESETS["gpt_1b"].num_params() >= 1_000_000_000


def test_forward_shapes_tied_weights_and_gqa():
    args = model_args("gpt_nano", tie_embeddings=True, n_kv_heads=2)
    model = build_model(args, device="cpu")
    model.init_weights(seed=0)
    assert model.output.weight is model.tok_embeddings.weight
    logits = model(torch.randint(0, args.vocab_size, (2, 16)))
    assert logits.shape == (2, 16, args.vocab_size)
    assert torch.isfinite(logits).all()


def test_causal_a_token_does_not_see_the_future():
    model = build_model(model_args("gpt_nano"), device="cpu")
    model.init_weights(seed=0)
    x = torch.randint(0, 256, (1, 12))
    y = x.clone()
    y[0, 8:] = (y[0, 8:] + 1) % 256
    torch.testing.assert_close(model(x)[0, :8], model(y)[0, :8])


def test_init_is_seeded_named_and_blockwise_invariant():
    a = torch.empty(5000, 300)  # 300 floats a row -> 3,495 rows a block: two blocks
    init.normal_(a, std=0.02, seed=7, name="w")
    b = torch.empty(5000, 300)
    init.normal_(b, std=0.02, seed=7, name="w")
    assert torch.equal(a, b)
    c = torch.empty(5000, 300)
    init.normal_(c, std=0.02, seed=7, name="other")
    assert not torch.equal(a, c)
    assert a.std().item() == pytest.approx(0.02, rel=0.01)
    # Distinct blocks are distinct streams (no repeated rows across a block boundary).
    assert not torch.equal(a[:10], a[3495:3505])


def test_init_weights_follow_gpt2_scales():
    model = build_model(model_args("gpt_small", n_layers=2, vocab_size=1024), device="cpu")
    model.init_weights(seed=1)
    assert model.layers["0"].attention.wq.weight.std().item() == pytest.approx(0.02, rel=0.02)
    assert model.layers["0"].feed_forward.w2.weight.std().item() == pytest.approx(
        0.02 / 2, rel=0.02
    )
    assert torch.equal(model.norm.weight, torch.ones_like(model.norm.weight))


def test_synthetic_data_is_deterministic_per_index_and_learnable():
    src = _SyntheticBigram(vocab_size=64, seq_len=16, seed=3)
    assert torch.equal(
        src.samples(range(5, 9)), torch.cat([src.samples(range(i, i + 1)) for i in range(5, 9)])
    )
    assert not torch.equal(src.samples(range(0, 1)), src.samples(range(1, 2)))
    assert src.entropy() < math.log(64) / 2
    t = src.samples(range(0, 4))
    # Every transition is one of the token's fixed successors.
    for row in t:
        for a, b in zip(row[:-1], row[1:]):
            assert b in src.successors[a]


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_ranks_read_disjoint_parts_that_make_up_the_global_batch(dp: int):
    src = _SyntheticBigram(vocab_size=64, seq_len=8, seed=0)
    layout = BatchLayout(
        global_batch_size=8,
        micro_batch_size=2 if dp < 4 else 1,
        dp_size=dp,
        grad_accum_steps=8 // ((2 if dp < 4 else 1) * dp),
    )
    for step in range(2):
        parts = []
        for rank in range(dp):
            cursor = BatchCursor(src, layout, rank, position=8 * step)
            micro = cursor.next_batch()
            assert len(micro) == layout.grad_accum_steps
            assert cursor.position == 8 * (step + 1)
            parts += [torch.cat([x, y[:, -1:]], dim=1) for x, y in micro]
        assert torch.equal(torch.cat(parts), src.samples(range(8 * step, 8 * step + 8)))


def test_a_tensor_parallel_group_reading_different_batches_is_refused():
    """DeepSpeed AutoTP's guard, on the first batch: ranks that must read the same batch (a
    tensor-parallel group, or a pipeline's stages) and do not stop on every rank, with both
    checksums."""
    worker = REPO / "tests" / "workers" / "same_batch.py"
    kinds = ["pp_size", "pp_size", "tp_size", "tp_size"]  # both ranks' lines, sorted
    same = check(launch(2, worker, "same", torchrun=False))
    assert sorted(same.stdout.splitlines()) == [f"{kind}: read" for kind in kinds], same.stdout
    own = check(launch(2, worker, "own", torchrun=False))
    lines = sorted(own.stdout.strip().splitlines())
    refused = "the ranks of a tensor-, sequence- or pipeline-parallel group read different batches"
    assert [line.split(": ", 1)[0] for line in lines] == kinds and all(
        line.split(": ", 1)[1].startswith(refused) for line in lines
    ), own.stdout


@pytest.mark.parametrize(
    "sizes, world, peers",  # peers: each rank's same-batch groups, by a rank's global rank
    [
        # pp 2 x dp 2 (pp outermost): rank r's pipeline is r and r +- 2, never its dp peer
        ({"pp_size": 2}, 4, lambda r: [[r % 2, r % 2 + 2]]),
        # pp 2 x dp 2 x tp 2: its tensor-parallel pair, then its pipeline (r and r +- 4)
        (
            {"pp_size": 2, "tp_size": 2},
            8,
            lambda r: [[r - r % 2, r - r % 2 + 1], [r % 4, r % 4 + 4]],
        ),
    ],
    ids=["pp2-dp2", "pp2-dp2-tp2"],
)
def test_the_same_batch_groups_are_a_ranks_tensor_parallel_pair_and_its_pipeline(
    sizes, world, peers
):
    """`Topology.same_batch`, which the trainer hands to `BatchCursor`'s first-batch check: the
    groups' members, rank by rank, on the mesh the run builds (over torch's fake process group: group
    membership is bookkeeping, no collective runs)."""
    import torch.distributed as dist

    from fsdp_zero.config.schema import ParallelConfig
    from fsdp_zero.distributed import Topology
    from fsdp_zero.torch_private import FakeStore

    for rank in range(world):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        try:
            topology = Topology.of(ParallelConfig(**sizes), world).on("cpu")
            got = [sorted(dist.get_process_group_ranks(g)) for g in topology.same_batch()]
        finally:
            dist.destroy_process_group()
        assert got == peers(rank), (rank, got)


def _children() -> set[int]:
    """This process's child processes (from /proc)."""
    import os

    out = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == os.getpid():
            out.add(int(stat.parent.name))
    return out


def test_loader_workers_outlive_the_sigterm_a_scheduler_sends_every_process():
    """Slurm signals every process of a job step; the rank must get to its save, so its loader workers
    ignore SIGTERM and keep handing it batches."""
    import os
    import signal

    src = _SyntheticBigram(vocab_size=64, seq_len=8, seed=0)
    layout = BatchLayout(global_batch_size=4, micro_batch_size=2, dp_size=1, grad_accum_steps=2)
    before = _children()
    cursor = BatchCursor(src, layout, 0, num_workers=1)
    cursor.next_batch()
    workers = _children() - before
    assert len(workers) == 1
    os.kill(workers.pop(), signal.SIGTERM)
    for step in range(1, 5):  # past the two batches the worker had fetched ahead
        micro = cursor.next_batch()
        assert torch.equal(
            torch.cat([torch.cat([x, y[:, -1:]], dim=1) for x, y in micro]),
            src.samples(range(4 * step, 4 * step + 4)),
        )


def test_byte_text_reads_a_folder_as_bytes(tmp_path: Path):
    (tmp_path / "a.txt").write_text("hello world, " * 20)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_text("more text " * 20)
    src = _ByteText(tmp_path, seq_len=16, seed=0)
    t = src.samples(range(0, 40))  # more than one pass: the order reshuffles
    assert t.shape == (40, 17) and t.max() < 256
    text = (tmp_path / "a.txt").read_bytes() + (tmp_path / "sub" / "b.txt").read_bytes()
    assert bytes(t[0].tolist()) in text
    with pytest.raises(ValueError, match="fewer than data.seq_len"):
        _ByteText(tmp_path / "a.txt", seq_len=10_000, seed=0)


def test_lr_warms_up_then_decays_to_the_floor():
    cfg = OptimConfig(lr=1.0, warmup_steps=4, min_lr_ratio=0.1)
    f = [lr_factor(s, cfg, total_steps=20) for s in range(20)]
    assert f[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(a >= b for a, b in zip(f[4:], f[5:]))
    # Worked out by hand: 0-based step 12 is half-way through the 16 decay steps,
    # 0.1 + 0.9 * (1 + cos(pi / 2)) / 2 = 0.55; step 8 a quarter of the way,
    # 0.1 + 0.9 * (1 + cos(pi / 4)) / 2 = 0.8681980515...
    assert f[12] == pytest.approx(0.55, abs=1e-12)
    assert f[8] == pytest.approx(0.8681980515339464, abs=1e-12)
    assert lr_factor(20, cfg, 20) == pytest.approx(0.1)


def test_reference_schedule_agrees_with_the_hand_worked_values():
    from tests.reference import reference_lr

    cfg = OptimConfig(lr=1.0, warmup_steps=4, min_lr_ratio=0.1)
    assert reference_lr(cfg, 1, 20) == 0.25 and reference_lr(cfg, 4, 20) == 1.0
    assert reference_lr(cfg, 13, 20) == pytest.approx(0.55, abs=1e-12)
    assert reference_lr(cfg, 9, 20) == pytest.approx(0.8681980515339464, abs=1e-12)
    # Linear decay: step 13 is half-way from 1.0 to 0.1; constant stays at 1.0.
    from fsdp_zero.config.choices import Schedule

    linear, constant = (
        OptimConfig(lr=1.0, warmup_steps=4, min_lr_ratio=0.1, schedule=Schedule(s))
        for s in ("linear", "constant")
    )
    assert (
        reference_lr(linear, 13, 20) == pytest.approx(0.55, abs=1e-12)
        and reference_lr(linear, 1, 20) == 0.25
    )
    assert reference_lr(constant, 13, 20) == reference_lr(constant, 20, 20) == 1.0


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
def test_every_schedule_agrees_with_the_reference(schedule):
    from fsdp_zero.config.choices import Schedule
    from fsdp_zero.training.step import lr_factor
    from tests.reference import reference_lr

    cfg = OptimConfig(lr=1.0, warmup_steps=4, min_lr_ratio=0.1, schedule=Schedule(schedule))
    for step in range(20):
        assert lr_factor(step, cfg, 20) == pytest.approx(
            reference_lr(cfg, step + 1, 20), abs=1e-12
        ), step


def test_model_state_bytes_for_adamw_is_16_per_param():
    model = build_model(model_args("gpt_nano", tie_embeddings=True), device="cpu")
    model.init_weights(seed=0)
    opt = torch.optim.AdamW(model.parameters(), foreach=True)
    model(torch.randint(0, 256, (1, 8))).sum().backward()
    opt.step()
    state = model_state_bytes(model, opt)
    n = sum(p.numel() for p in model.parameters())  # the tied weight once
    assert state.params == 4 * n and state.grads == 4 * n
    assert state.optimizer == pytest.approx(8 * n, abs=8 * 64)  # + one scalar `step` per tensor


def test_cpu_memory_monitor_reads_rss_and_resets_its_peak():
    monitor = MemoryMonitor(torch.device("cpu"))
    before = monitor.read()
    big = torch.ones(64 * 2**20 // 4)  # 64 MiB touched
    during = monitor.read()
    assert during["cpu_rss_mib"] >= before["cpu_rss_mib"] + 60
    # The kernel's high-water mark, read after the RSS: never below it (and in the same unit).
    assert during["cpu_peak_rss_mib"] >= during["cpu_rss_mib"]
    assert during["cpu_peak_rss_mib"] < during["cpu_rss_mib"] + 1024
    del big
    monitor.reset_peaks()
    after = monitor.read()
    if Path("/proc/self/clear_refs").exists():
        assert after["cpu_peak_rss_mib"] < during["cpu_peak_rss_mib"] - 30
    assert "cuda_allocated_mib" not in after


_MONITOR = """
import torch
from fsdp_zero.monitor.memory import MemoryMonitor
assert not torch.cuda.is_initialized()
monitor = MemoryMonitor(torch.device("cuda", 0))  # built before anything touched CUDA: it initialises it itself
x = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
m = monitor.read()
assert m["cuda_allocated_mib"] >= 256 and m["cuda_peak_reserved_mib"] >= m["cuda_peak_allocated_mib"] >= 256, m
del x
torch.cuda.empty_cache()
monitor.reset_peaks()
assert monitor.read()["cuda_peak_allocated_mib"] < 256
print("ok")
"""


@pytest.mark.gpu
def test_cuda_memory_monitor_reports_the_allocator(tmp_path: Path):
    """In a fresh process, where nothing has started CUDA before the monitor (in the suite's own process a
    gpu test before it would have, and the monitor's own initialisation would go untested)."""
    script = tmp_path / "monitor.py"
    script.write_text(_MONITOR)
    assert check(launch(0, script, gpu=True)).stdout.strip() == "ok"


def _checkpoint(run_dir: Path, step: int, cfg) -> Path:
    """The files that make a checkpoint folder complete (its tensors do not matter to the policy)."""
    from fsdp_zero.config.loader import to_yaml

    path = run_dir / "checkpoints" / f"step-{step:07d}"
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"")
    (path / "train_state.json").write_text(
        json.dumps({"step": step, "data_position": 8 * step, "seed": cfg.train.seed})
    )
    (path / "config.yaml").write_text(to_yaml(cfg))
    return path


def test_run_directory_policy_in_process(tmp_path: Path):
    from fsdp_zero.config.loader import load_config, to_yaml
    from fsdp_zero.training.rundir import RunDecision, _plan_run_dir, run_files, write_run_dir

    base = ["model.preset=gpt_nano", f"run.root={tmp_path}", "run.name=r"]
    run_dir = tmp_path / "r"
    cfg = load_config(None, base)
    # nothing there: fresh
    assert _plan_run_dir(cfg, run_dir, seed_was_set=True) == RunDecision(run_dir, None, 1234)
    write_run_dir(run_dir, run_files(to_yaml(cfg), cfg.model, run_dir, 0, "plan"), tag="0")
    assert (run_dir / "config.yaml").read_text() == to_yaml(cfg) and (
        run_dir / "wrap_plan.txt"
    ).read_text() == "plan\n"
    with pytest.raises(ValueError, match="already holds a run with a different config"):
        _plan_run_dir(load_config(None, base + ["train.steps=7"]), run_dir, seed_was_set=True)

    _checkpoint(run_dir, 2, cfg)
    latest = _checkpoint(run_dir, 4, cfg)
    assert (
        _plan_run_dir(
            load_config(None, base + ["optim.lr=1e-3", "data.num_workers=1"]), run_dir, True
        ).resume
        == latest
    )
    with pytest.raises(
        ValueError,
        match=r"checkpoint\.resume=none but run directory .* holds checkpoints \(newest step-0000004\)",
    ):
        _plan_run_dir(load_config(None, base + ["checkpoint.resume=none"]), run_dir, True)
    with pytest.raises(ValueError, match=r"model\.n_layers: None in the checkpoint, 3 now"):
        _plan_run_dir(load_config(None, base + ["model.n_layers=3"]), run_dir, True)
    older = load_config(
        None, base + [f"checkpoint.resume={run_dir / 'checkpoints' / 'step-0000002'}"]
    )
    with pytest.raises(ValueError, match=r"holds newer checkpoints \(step-0000004\)"):
        _plan_run_dir(older, run_dir, True)
    drawn = load_config(None, base + ["train.seed=99"])  # train.seed=null, with rank 0's draw (99)
    decision = _plan_run_dir(drawn, run_dir, seed_was_set=False)
    # the checkpoint's seed; the config untouched
    assert decision.seed == cfg.train.seed and drawn.train.seed == 99
    assert decision.run_dir.name == "r"  # (decide_run's config takes both)

    # After a crash at step 6, metrics past the step-4 checkpoint are dropped; the old log is kept.
    (run_dir / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s}) + "\n" for s in range(1, 7))
    )
    write_run_dir(run_dir, run_files(to_yaml(cfg), cfg.model, run_dir, 4, "plan"), tag="4")
    assert [row["step"] for row in RunDir(run_dir).metric_rows()] == [1, 2, 3, 4]
    assert len((run_dir / "metrics.jsonl.4").read_text().splitlines()) == 6


def test_learning_rate_is_set_from_the_step_alone():
    from fsdp_zero.config.schema import OptimConfig
    from fsdp_zero.training.step import set_lr
    from tests.reference import reference_lr

    cfg = OptimConfig(lr=1e-2, warmup_steps=3, min_lr_ratio=0.1)
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=0.5)
    for step in (7, 0, 19, 3):  # any order: no state carried between calls
        assert set_lr(opt, cfg, step, 20) == pytest.approx(
            reference_lr(cfg, step + 1, 20), abs=1e-15
        )
        assert opt.param_groups[0]["lr"] == pytest.approx(
            reference_lr(cfg, step + 1, 20), abs=1e-15
        )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"strategy": "zero9"},
            "strategy='zero9' is not a valid choice; valid choices: full_shard, shard_grad_op",
        ),
        (
            {"precision": "fp8"},
            "precision='fp8' is not a valid choice; valid choices: fp32, bf16-mixed, fp16-mixed, bf16-true",
        ),
        (
            {"activation_checkpointing": "some"},
            "activation_checkpointing='some' is not a valid choice; valid choices: none",
        ),
    ],
)
def test_own_loop_shard_names_a_bad_argument(kwargs, message):
    from fsdp_zero.api import shard

    with pytest.raises(ValueError) as e:
        shard(torch.nn.Linear(2, 2), None, **kwargs)  # checked before anything is built
    assert str(e.value).startswith(message)


def test_train_state_round_trips_and_reads_checkpoints_written_before_it(tmp_path: Path):
    from fsdp_zero.checkpoint.dcp import TrainState, read_train_state

    state = TrainState(
        step=7,
        data_position=56,
        skipped_nonfinite=1,
        loss_scaler={"scale": 1024.0},
        deadline=1.5e9,
        job="j",
        world_size=2,
        versions={"torch": "x"},
        extra={"samples_seen": 3},
    )
    text = state.to_json()
    assert TrainState.from_json(text) == state
    # the own loop's keys, flat
    assert json.loads(text)["samples_seen"] == 3 and "extra" not in json.loads(text)
    # no budget: nothing of it written, as before
    assert "deadline" not in TrainState(step=1).to_json()
    # A train_state.json as the trainer wrote it before TrainState (an unread "seed", the budget's keys):
    old = {
        "step": 4,
        "data_position": 32,
        "seed": 1234,
        "skipped_nonfinite": 0,
        "deadline": 2.0,
        "job": "a",
        "loss_scaler": {"scale": 8.0},
        "world_size": 2,
        "versions": {"torch": "2.15", "fsdp_zero": "0.1.0"},
    }
    ckpt = tmp_path / "step-0000004"
    ckpt.mkdir()
    for name in (".metadata", "config.yaml"):
        (ckpt / name).write_text("")
    (ckpt / "train_state.json").write_text(json.dumps(old))
    assert read_train_state(ckpt) == TrainState(
        4, 32, 0, {"scale": 8.0}, 2.0, "a", 2, old["versions"]
    )
    (ckpt / "train_state.json").write_text(json.dumps({"data_position": 1}))
    with pytest.raises(ValueError, match="train_state.json is corrupt: no integer 'step'"):
        read_train_state(ckpt)
