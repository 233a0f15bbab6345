"""Validation (eval.*): the loss every eval.every steps and at the last, split over ranks, training untouched.

The runs are tests/batches' ``eval`` (n2 with validation: ZeRO-3 at 2 ranks, 5 windows, so
rank 0 evaluates 3 and rank 1 2 and a dummy batch) and ``eval-n1`` (one rank, micro-batch 4).
Each evaluation at the last step is compared with a single-process computation written here in
plain torch on the run's final full weights; the training losses, gradient norms and weights of
``eval`` with those of ``n2``, bit for bit. Bad settings run scripts/train.py's main in this process.

Seen failing: counting the dummy batch (the 2-rank loss moves off the reference); leaving out FSDP2's
``reset_iter_state`` (the root stays gathered, and the training losses after the first evaluation
change); leaving out ``eval()`` or ``no_grad`` (the in-process classification test). Leaving out the
dummy forward hangs rank 0 in an all-gather while rank 1 waits in the all-reduce, until
dist.step_timeout_minutes ends the run with exit code 5 (tried by hand at 0.25 minutes: 20 s).

Covers: fsdp_zero/training/evaluate.py
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from fsdp_zero.config import RunDir
from fsdp_zero.config.loader import load_config
from fsdp_zero.distributed.env import DistEnv
from fsdp_zero.model.transformer import _args_from_config
from fsdp_zero.training.evaluate import _FolderImages, _rank_batches, build_evaluator
from tests.batches import BASE, EVAL_TOKENS
from tests.conftest import TRAIN, build_model, figure, run_script

SEQ_LEN = 32  # BASE's data.seq_len
EVAL_STEPS = [3, 6, 8]  # eval.every=3 over 8 steps, and the last
EVAL_ATOL = 1e-5


def single_process_eval_loss(final: dict[str, torch.Tensor], val: Path) -> float:
    """The token-weighted mean next-token cross-entropy over windows of SEQ_LEN + 1 tokens at stride SEQ_LEN,
    computed from the definition: one window at a time, the whole model in this process."""
    model = build_model(_args_from_config(load_config(None, list(BASE)).model), device="cpu")
    model.load_state_dict(final)
    model.eval()
    tokens = torch.from_numpy(np.fromfile(val, dtype=np.uint16).astype(np.int64))
    total, count = 0.0, 0
    with torch.no_grad():
        for k in range((len(tokens) - 1) // SEQ_LEN):
            window = tokens[k * SEQ_LEN : k * SEQ_LEN + SEQ_LEN + 1]
            logits = model(window[None, :-1])[0].double()
            total += F.cross_entropy(logits, window[1:], reduction="sum").item()
            count += SEQ_LEN
    assert count == 5 * SEQ_LEN
    return total / count


@pytest.mark.parametrize("name", ["eval", "eval-n1", "zero2", "ddp"])
def test_the_eval_loss_equals_a_single_process_computation(batches, name):
    run = batches[name]
    assert sorted(run["evals"]) == EVAL_STEPS, run["evals"]
    val = batches.root / "val.bin"
    assert val.stat().st_size == EVAL_TOKENS * 2
    expected = single_process_eval_loss(run["final"], val)
    got = run["evals"][8]
    diff = abs(got["eval/loss"] - expected)
    figure(f"eval/loss against a single process ({name})", f"{diff:.2e} (loss {expected:.6f})")
    assert diff < EVAL_ATOL, (got, expected)
    assert got["eval/perplexity"] == pytest.approx(math.exp(got["eval/loss"]), rel=1e-12)


def test_the_eval_loss_is_the_same_at_one_and_two_ranks(batches):
    # Different runs (2 ranks x micro-batch 2, 1 rank x 4): their weights differ by the order of reductions.
    one, two = batches["eval-n1"]["evals"], batches["eval"]["evals"]
    assert all(abs(one[s]["eval/loss"] - two[s]["eval/loss"]) < EVAL_ATOL for s in EVAL_STEPS), (
        one,
        two,
    )


def test_training_is_bit_identical_with_evaluation_on_and_off(batches):
    on, off = batches["eval"], batches["n2"]
    assert on["losses"] == off["losses"] and on["grad_norms"] == off["grad_norms"]
    assert all(torch.equal(on["final"][k], off["final"][k]) for k in off["final"])
    assert not off["evals"]


@pytest.mark.parametrize("name", ["eval", "zero2", "ddp"])
def test_evaluation_leaves_every_unit_sharded(batches, name):
    # The last step evaluates after its optimizer step: a forward without backward would leave the root unit
    # gathered (parallelize.py), under ZeRO-2 every unit (reshard_after_forward=False), their parameters held
    # whole until the next forward's backward. DDP holds whole parameters throughout (evaluated through its
    # wrapper's module).
    for held in batches[name]["param_bytes"]:
        assert held["after_train"] == held["before_step"], held


def test_eval_scalars_reach_metrics_jsonl_and_tensorboard_at_every_k_and_the_last(batches):

    run_dir = batches.path("eval")
    rows = RunDir(run_dir).metric_rows()
    evals = {r["step"]: r for r in rows if "eval/loss" in r}
    assert sorted(evals) == EVAL_STEPS
    # the training rows as before
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, 9))
    expected = batches["eval"]["evals"]
    for rank in (0, 1):
        acc = EventAccumulator(str(run_dir / "tb" / f"rank{rank}"), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in ("eval/loss", "eval/perplexity"):
            events = acc.Scalars(tag)
            assert [e.step for e in events] == EVAL_STEPS, (rank, tag)
            assert all(e.value == pytest.approx(expected[e.step][tag], rel=1e-6) for e in events)
            assert all(e.value == pytest.approx(evals[e.step][tag], rel=1e-6) for e in events)


def test_evaluation_does_not_raise_the_peak_memory(batches):
    """Peak RSS per rank at 2 ranks (gpt_nano, ZeRO-3): the run without evaluation, the run with it, and
    from a log step through an evaluation (log_every=1: the evaluation's own). At this size both are
    the process's heap, flat to within a MiB: the bound is a gross one (an evaluation that held on to
    activations or gathered units at gpt_small's size would break it by hundreds of MiB), and
    docs/fine-tuning.md gives the figures of a 21M-parameter model."""

    (off_peak, _), (on_peak, eval_peak) = (
        batches["n2"]["peak_mib"][0],
        batches["eval"]["peak_mib"][0],
    )
    figure(
        "peak RSS rank 0, gpt_nano at 2 ranks (MiB)",
        f"without eval {off_peak:.1f}, with eval {on_peak:.1f}, through each evaluation {eval_peak:.1f}",
    )
    rows = RunDir(batches.path("eval")).metric_rows()
    # Intervals of training alone: not the profiled step 2, nor 4 and 7 (they hold the evaluations after 3 and 6).
    training = [
        r["peak_mem_mib_per_rank"] for r in rows if r["step"] in (1, 3, 5, 6, 8) and "loss" in r
    ]
    for rank, (_, evaluating) in enumerate(batches["eval"]["peak_mib"]):
        assert 0 < evaluating <= max(t[rank] for t in training) + 2.0, (rank, evaluating, training)


@pytest.mark.parametrize(
    "args,message",
    [
        (["eval.every=-1"], "eval.every=-1: must be >= 0 (0: no evaluation)"),
        (
            ["eval.max_batches=-2", "eval.path=VAL"],
            "eval.max_batches=-2: must be >= 0 (0: the whole file)",
        ),
        (["eval.every=5"], "eval.every=5 needs eval.path: a token file (.bin or .npy)"),
        (["eval.every=5", "eval.path=NOPE"], "no such file or folder"),
        (
            ["eval.every=5", "eval.path=DIR"],
            "model.task=causal_lm evaluates a token file (.bin or .npy)",
        ),
        (
            [
                "eval.every=5",
                "eval.path=DIR",
                "model.task=custom",
                "model.loss=tests.user_model:overflow_on_rank1",
            ],
            "model.task=custom cannot be evaluated",
        ),
        (
            ["eval.every=5", "eval.path=BIG"],
            "eval.path='BIG' holds token id 300, but the model's vocabulary has 256",
        ),
        (
            ["eval.every=5", "eval.path=SHORT"],
            "eval.path='SHORT' holds 20 tokens, fewer than data.seq_len + 1 = 33",
        ),
    ],
)
def test_bad_eval_settings_exit_2_with_one_line_and_write_nothing(tmp_path: Path, args, message):
    files = {
        "VAL": tmp_path / "val.bin",
        "NOPE": tmp_path / "nope.bin",
        "DIR": tmp_path,
        "BIG": tmp_path / "big.bin",
        "SHORT": tmp_path / "short.bin",
    }
    np.arange(100, dtype=np.uint16).tofile(files["VAL"])
    np.full(100, 300, dtype=np.uint16).tofile(files["BIG"])
    np.arange(20, dtype=np.uint16).tofile(files["SHORT"])
    for key, path in files.items():  # the placeholders, in the arguments and the expected line
        args = [a.replace(f"={key}", f"={path}") for a in args]
        message = message.replace(f"'{key}'", repr(str(path)))
    proc = run_script(TRAIN, *BASE, *args, f"run.root={tmp_path}", "run.name=bad")
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and message in errors[0] and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize(
    "num_items,world_size,micro", [(5, 2, 2), (5, 2, 1), (1, 4, 2), (7, 3, 2), (8, 4, 4), (3, 1, 2)]
)
def test_every_item_is_evaluated_once_and_every_rank_forwards_as_often(
    num_items, world_size, micro
):
    shares = [_rank_batches(num_items, world_size, rank, micro) for rank in range(world_size)]
    # the same number of forwards (all-gathers) on every rank
    assert len({len(share) for share in shares}) == 1
    assert sorted(i for share in shares for batch in share for i in batch) == list(range(num_items))
    assert all(len(batch) <= micro for share in shares for batch in share)
    if (num_items, world_size, micro) == (5, 2, 2):
        assert shares == [[[0, 2], [4]], [[1, 3], []]]  # rank 1's second forward is the dummy


def _image_folder(
    root: Path, classes: tuple[str, ...] = ("ant", "bee", "cat"), per_class: int = 2
) -> Path:
    from PIL import Image

    gen = np.random.default_rng(0)
    for name in classes:
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            Image.fromarray(gen.integers(0, 256, (12, 10, 3), dtype=np.uint8)).save(
                root / name / f"{i}.png"
            )
    return root


def test_classification_evaluates_loss_and_accuracy_in_eval_mode_without_drawing_random_numbers(
    tmp_path: Path,
):
    folder = _image_folder(tmp_path / "val")
    cfg = load_config(
        None,
        [
            "model.task=classification",
            "data.source=fake_images",
            "data.image_size=8",
            "eval.every=1",
            f"eval.path={folder}",
            "train.global_batch_size=4",
            "train.micro_batch_size=2",
        ],
    )
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Flatten(), torch.nn.Dropout(0.5), torch.nn.Linear(3 * 8 * 8, 3)
    )
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
    whole = build_evaluator(cfg, env, model, None)
    rng, grad_modes = torch.get_rng_state(), []
    hook = model.register_forward_hook(lambda *_: grad_modes.append(torch.is_grad_enabled()))
    result = whole.run(model)  # 6 images: forwards of 2, 2 and 2
    hook.remove()
    # no autograd graph: no activations kept for a backward that never comes
    assert grad_modes == [False] * 3
    assert torch.equal(torch.get_rng_state(), rng) and model.training

    images, labels = _FolderImages(str(folder), 8).batch(range(6))
    model.eval()
    with torch.no_grad():
        logits = model(images).double()
    assert result.items == 6 and result.scalars["eval/loss"] == pytest.approx(
        F.cross_entropy(logits, labels).item(), abs=1e-6
    )
    assert result.scalars["eval/accuracy"] == (logits.argmax(-1) == labels).double().mean().item()

    cfg.eval.max_batches = 1  # one global batch of 4: the same 4 images at any world size
    assert build_evaluator(cfg, env, model, None).num_items == 4


def test_a_token_file_is_read_as_its_meta_json_says_in_file_order(tmp_path: Path):
    # uint32 ids with prepare_data's meta.json beside them: the training's own reader follows it
    tokens = np.random.default_rng(1).integers(0, 256, 3 * SEQ_LEN + 7).astype(np.uint32)
    tokens.tofile(tmp_path / "val.bin")
    (tmp_path / "meta.json").write_text('{"dtype": "uint32", "vocab_size": 256}')
    cfg = load_config(
        None,
        [
            "model.preset=gpt_nano",
            f"data.seq_len={SEQ_LEN}",
            "eval.every=2",
            f"eval.path={tmp_path / 'val.bin'}",
            "train.global_batch_size=4",
            "train.micro_batch_size=2",
        ],
    )
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(256, 8), torch.nn.Linear(8, 256))
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
    evaluator = build_evaluator(cfg, env, model, None)
    assert evaluator.num_items == 3 and evaluator.batches == [[0, 1], [2]]
    inputs, targets = evaluator.items.batch([2])
    assert inputs[0].tolist() == tokens[2 * SEQ_LEN : 3 * SEQ_LEN].tolist()
    assert targets[0].tolist() == tokens[2 * SEQ_LEN + 1 : 3 * SEQ_LEN + 1].tolist()
    result = evaluator.run(model)
    windows = torch.from_numpy(tokens[: 3 * SEQ_LEN + 1].astype(np.int64))
    with torch.no_grad():
        # the windows join end to end
        expected = F.cross_entropy(model(windows[:-1]).double(), windows[1:]).item()
    assert result.count == 3 * SEQ_LEN and result.scalars["eval/loss"] == pytest.approx(
        expected, abs=1e-6
    )
    assert [evaluator.due(s, 5) for s in range(1, 6)] == [False, True, False, True, True]


def test_image_folders_the_model_cannot_be_evaluated_on_are_refused_and_an_unused_path_is_named(
    tmp_path: Path, caplog
):
    """An eval folder whose classes are not the training folder's (ImageFolder numbers classes by sorted
    folder name: one more folder shifts every label), or that has more classes than the model's last layer
    has outputs, is refused, naming eval.path; an eval.path with eval.every=0 is said to do nothing."""
    import logging

    train = _image_folder(tmp_path / "train", ("ant", "bee", "cat"))
    other = _image_folder(tmp_path / "other", ("ant", "bee", "dog"))
    more = _image_folder(tmp_path / "more", ("ant", "bee", "cat", "dog"))
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
    base = [
        "model.task=classification",
        "data.image_size=8",
        "eval.every=1",
        "train.global_batch_size=4",
        "train.micro_batch_size=2",
    ]
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 8 * 8, 3))
    images = load_config(
        None, [*base, "data.source=images", f"data.path={train}", f"eval.path={other}"]
    )
    with pytest.raises(
        ValueError,
        match=r"eval.path='.*other' has classes \['ant', 'bee', 'dog'\], but data.path has "
        r"\['ant', 'bee', 'cat'\]; give both the same class folders",
    ):
        build_evaluator(images, env, model, _FolderImages(str(train), 8))
    fake = load_config(None, [*base, "data.source=fake_images", f"eval.path={more}"])
    with pytest.raises(
        ValueError,
        match=r"eval.path='.*more' has 4 classes but the model's last layer has 3 outputs",
    ):
        build_evaluator(fake, env, model, None)
    unused = load_config(
        None, [*base, "data.source=fake_images", "eval.every=0", f"eval.path={train}"]
    )
    with caplog.at_level(logging.WARNING, logger="fsdp_zero"):
        assert build_evaluator(unused, env, model, None) is None
    assert f"eval.path={train} has no effect with eval.every=0 (no evaluation)" in caplog.text


def test_evaluation_time_is_left_out_of_the_throughput(tmp_path: Path, monkeypatch):
    """The tokens/s of a log interval that held an evaluation count the training steps' time only
    (`StepLogger.evaluation` moves the interval's start by the evaluation's seconds): a half-second
    evaluation between two steps of a few milliseconds leaves the rate where it was, in process on a
    one-rank gloo group."""
    import time

    import fsdp_zero.api as fz
    from fsdp_zero.training.evaluate import EvalResult
    from fsdp_zero.training.steplog import LogPlan, StepLogger

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    with fz.distributed(device="cpu", backend="gloo") as env:
        model = torch.nn.Linear(4, 4)
        optimizer = torch.optim.AdamW(model.parameters())
        plan = LogPlan(
            log_every=1,
            last_step=2,
            profile_step=0,
            items_per_rank_step=1000,
            unit="tokens",
            tensorboard=False,
        )
        log = StepLogger(env, tmp_path, model, optimizer, plan)
        zero = torch.zeros(())
        log.step(1, zero, zero, 1e-3, {})
        time.sleep(0.5)  # the evaluation
        log.evaluation(1, EvalResult({"eval/loss": 1.0}, 1, "windows", 1, seconds=0.5))
        log.step(2, zero, zero, 1e-3, {})
        log.close()
    rows = RunDir(tmp_path).metric_rows()
    rates = [r["tokens_per_s_all_ranks"] for r in rows if "loss" in r]
    # with the evaluation's 0.5 s: under 2,000 tokens/s
    assert len(rates) == 2 and rates[1] > 10 * 1000 / 0.5, rates
