"""Instruction data with masked prompts (issue 20, point 4): prepare's two formats and their mask files,
the token-weighted loss over the global batch, and validation on a masked held-out file.

The training runs are batched (`tests/batches/`: ``masked`` at N = 2 and micro-batch 2,
``masked-noclip`` the same without clipping, ``masked-n1`` at N = 1 with 4 accumulated micro-batches
of 2, ``masked-n1-mb8`` with one of 8). Each is compared on its losses, gradient norms and weights.

Covers: fsdp_zero/data/token_files.py, fsdp_zero/data/prepare.py, fsdp_zero/model/tasks.py,
    fsdp_zero/training/step.py
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fsdp_zero.config.choices import Task
from fsdp_zero.config.loader import load_config
from fsdp_zero.data.batches import TokenFile
from fsdp_zero.data.prepare import Fields, _validation_documents, prepare
from fsdp_zero.data.token_files import IGNORE_INDEX, mask_file
from fsdp_zero.model.tasks import _lm_sums, _masked_causal_lm, build_task, trained_tokens
from fsdp_zero.model.transformer import _args_from_config
from fsdp_zero.training.step import Step
from tests.batches import BASE, MASKED
from tests.conftest import build_model, figure
from tests.reference import reference_run
from tests.test_parity import LOSS_ATOL, NORM_ATOL, WEIGHT_ATOL

# A chat template of the simplest kind: a header line per turn, the content, an end marker.
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
RECORDS = [
    ("Say hello to the world", "hello world and all the rest"),
    ("Count from one to three", "one two three"),
    ("Name a colour", "the sky is blue"),
    ("What is two and two", "two and two make four"),
]


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _read(out: Path, split: str = "train") -> tuple[np.ndarray, np.ndarray]:
    meta = json.loads((out / "meta.json").read_text())
    return np.fromfile(out / f"{split}.bin", dtype=meta["dtype"]), np.fromfile(
        mask_file(out / f"{split}.bin"), np.uint8
    )


def _trained_spans(ids: np.ndarray, mask: np.ndarray) -> list[list[int]]:
    """The runs of consecutive trained tokens, as id lists."""
    spans, current = [], []
    for token, m in zip(ids.tolist(), mask.tolist()):
        if m:
            current.append(token)
        elif current:
            spans, current = [*spans, current], []
    return spans + ([current] if current else [])


def _chat_tokenizer(folder: Path, tokenizer_dir: Path, template: str = TEMPLATE) -> Path:
    """A copy of the test tokenizer's folder whose tokenizer has ``template`` as its chat template."""
    from transformers import AutoTokenizer

    shutil.copytree(tokenizer_dir, folder)
    tok = AutoTokenizer.from_pretrained(folder)
    tok.chat_template = template
    tok.save_pretrained(folder)
    return folder


def test_prompt_completion_marks_exactly_the_completion_and_its_eos(
    tmp_path: Path, tiny_tokenizer_dir: Path
):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    data = _write_jsonl(tmp_path / "sft.jsonl", [{"q": p, "a": c} for p, c in RECORDS])
    meta, _ = prepare(
        tiny_tokenizer_dir,
        [data],
        tmp_path / "out",
        val_fraction=0,
        fields=Fields("prompt_completion", prompt="q", completion="a"),
    )
    ids, mask = _read(tmp_path / "out")
    assert (
        len(mask) == len(ids) == meta["train"]["tokens"] and meta["format"] == "prompt_completion"
    )
    spans = _trained_spans(ids, mask)
    # each completion, then EOS
    assert [tok.decode(s) for s in spans] == [c + "</s>" for _, c in RECORDS]
    assert meta["train"]["trained_tokens"] == int(mask.sum()) == sum(map(len, spans))
    untrained = tok.decode([t for t, m in zip(ids.tolist(), mask.tolist()) if not m])
    assert untrained == "".join("<s>" + p for p, _ in RECORDS)  # the prompts, each after its BOS
    assert json.loads((tmp_path / "out" / "meta.json").read_text())["val"]["trained_tokens"] == 0
    prepare(
        tiny_tokenizer_dir,
        [data],
        tmp_path / "two",
        val_fraction=0,
        fields=Fields("prompt_completion", prompt="q", completion="a"),
        workers=2,
    )  # each worker told the format
    for name in ("train.bin", "train.mask.bin", "val.mask.bin"):
        assert (tmp_path / "two" / name).read_bytes() == (tmp_path / "out" / name).read_bytes()


def test_chat_marks_exactly_the_assistant_turns(tmp_path: Path, tiny_tokenizer_dir: Path):
    from transformers import AutoTokenizer

    folder = _chat_tokenizer(tmp_path / "tok", tiny_tokenizer_dir)
    tok = AutoTokenizer.from_pretrained(folder)
    chats = [
        [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": p},
            {"role": "assistant", "content": c},
            {"role": "user", "content": "and again"},
            {"role": "assistant", "content": c.upper()},
        ]
        for p, c in RECORDS
    ]
    data = _write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in chats])
    meta, _ = prepare(folder, [data], tmp_path / "out", val_fraction=0, fields=Fields("chat"))
    ids, mask = _read(tmp_path / "out")
    assert len(mask) == len(ids) and meta["format"] == "chat" and meta["field"] == "messages"
    expected = [t for _, c in RECORDS for t in (f"{c}<|end|>\n", f"{c.upper()}<|end|>\n</s>")]
    # the assistant's content and the template's close of its turn; not its header, not the user's turns
    assert [tok.decode(s) for s in _trained_spans(ids, mask)] == expected
    assert meta["train"]["trained_tokens"] == int(mask.sum())


@pytest.mark.parametrize("fmt", ["prompt_completion", "chat"])
def test_each_split_has_its_own_mask_and_the_val_split_trains_on_its_completions(
    tmp_path: Path, tiny_tokenizer_dir: Path, fmt
):
    """An instruction-format prepare with a validation split (the default ``--val-fraction`` is 0.05): each
    split's mask file has one byte per token of its own ``.bin``, `TokenFile` opens both splits masked, and
    each split's trained spans are its own documents' completions and EOS. With ``val_fraction=0``, as the
    other prepares here, val.mask.bin is empty whichever split a mask is written to, which hides a mask
    written to the wrong file; and a mask of another length makes both files unreadable at start-up."""
    from transformers import AutoTokenizer

    # 8 distinct documents
    records = [(f"{p} ({i})", f"{c} {i}") for i, (p, c) in enumerate(RECORDS * 2)]
    if fmt == "chat":
        folder = _chat_tokenizer(tmp_path / "tok", tiny_tokenizer_dir)
        rows, close = (
            [
                {"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": c}]}
                for p, c in records
            ],
            "<|end|>\n</s>",
        )  # the template closes the assistant's turn
    else:
        folder, rows, close = (
            tiny_tokenizer_dir,
            [{"prompt": p, "completion": c} for p, c in records],
            "</s>",
        )
    data = _write_jsonl(tmp_path / "sft.jsonl", rows)
    meta, _ = prepare(folder, [data], tmp_path / "out", val_fraction=0.5, fields=Fields(fmt))
    tok, val = AutoTokenizer.from_pretrained(folder), _validation_documents(len(records), 0.5, 0)
    assert len(val) == 4  # both splits hold documents
    for split, docs in (
        ("train", [r for i, r in enumerate(records) if i not in val]),
        ("val", [records[i] for i in sorted(val)]),
    ):
        bin_path = tmp_path / "out" / f"{split}.bin"
        ids, mask = _read(tmp_path / "out", split)
        assert mask_file(bin_path).stat().st_size == len(ids) == meta[split]["tokens"] > 0, split
        assert [tok.decode(s) for s in _trained_spans(ids, mask)] == [c + close for _, c in docs], (
            split
        )
        assert meta[split]["documents"] == len(docs) and meta[split]["trained_tokens"] == int(
            mask.sum()
        )
        # what data.path and eval.path open: refused if the lengths differ
        source = TokenFile(bin_path, 4, 0)
        assert source.masked
        targets = source.pairs([0])[1][0].tolist()
        assert targets == [int(ids[j]) if mask[j] else IGNORE_INDEX for j in range(1, 5)], split


def _turns(last: str, prompt: str, completion: str) -> list[dict]:
    """A chat of a user turn and an assistant turn, then: a second exchange (``last`` assistant) or one
    more turn of ``last``'s role (user or system) that no assistant answers."""
    chat = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
    if last == "assistant":
        return [
            *chat,
            {"role": "user", "content": "and again"},
            {"role": "assistant", "content": completion.upper()},
        ]
    return [*chat, {"role": last, "content": "thanks, that will do"}]


@pytest.mark.parametrize("last", ["assistant", "user", "system"])
def test_the_final_eos_is_trained_only_after_an_assistant_turn(
    tmp_path: Path, tiny_tokenizer_dir: Path, last
):
    """The EOS that ends a chat is the answer's end only when the assistant spoke last: after a user or a system
    turn, predicting it would train the model to end a conversation with an unanswered message."""
    from transformers import AutoTokenizer

    folder = _chat_tokenizer(tmp_path / "tok", tiny_tokenizer_dir)
    data = _write_jsonl(
        tmp_path / "chat.jsonl", [{"messages": _turns(last, p, c)} for p, c in RECORDS]
    )
    prepare(folder, [data], tmp_path / "out", val_fraction=0, fields=Fields("chat"))
    ids, mask = _read(tmp_path / "out")
    tok = AutoTokenizer.from_pretrained(folder)
    ends = np.flatnonzero(ids == tok.eos_token_id)
    assert len(ends) == len(RECORDS) and ends[-1] == len(ids) - 1  # one EOS a chat, at its end
    assert mask[ends].tolist() == [int(last == "assistant")] * len(RECORDS)
    # the assistant turns are trained on whatever follows them; the last turn, when not the assistant's, is not
    per_chat = [
        f"{c}<|end|>\n" + (f"{c.upper()}<|end|>\n</s>" if last == "assistant" else "")
        for _, c in RECORDS
    ]
    spans = [tok.decode(s) for s in _trained_spans(ids, mask)]
    assert "".join(spans) == "".join(per_chat), spans


@pytest.mark.parametrize(
    "case, template",
    [
        ("a turn count first", "{{ messages | length }} turns\n" + TEMPLATE),
        ("the last message first", "{{ messages[-1]['content'] }}\n" + TEMPLATE),
    ],
)
def test_a_template_that_rewrites_earlier_turns_is_refused(
    tmp_path: Path, tiny_tokenizer_dir: Path, case, template
):
    """A template whose render of a conversation's first turns is not the start of the whole: the turns are found
    by rendering prefix by prefix, so its mask would mark other tokens than the assistant's. Refused, not guessed."""
    from tests.test_prepare import _refused

    folder = _chat_tokenizer(tmp_path / "tok", tiny_tokenizer_dir, template)
    data = _write_jsonl(
        tmp_path / "chat.jsonl", [{"messages": _turns("assistant", p, c)} for p, c in RECORDS]
    )
    line = _refused(folder, tmp_path, str(data), extra=("--format", "chat"))
    assert line == (
        "error: --format chat: the chat template renders a conversation's first 1 messages as "
        "other tokens than the start of the whole; its turns cannot be told apart "
        "(use --format prompt_completion)"
    )


def test_text_format_writes_no_mask_and_a_bad_format_is_one_line(
    tmp_path: Path, tiny_tokenizer_dir: Path
):
    data = _write_jsonl(tmp_path / "d.jsonl", [{"text": p} for p, _ in RECORDS])
    meta, _ = prepare(tiny_tokenizer_dir, [data], tmp_path / "out", val_fraction=0)
    assert not mask_file(tmp_path / "out" / "train.bin").exists() and meta["format"] == "text"
    assert set(meta["train"]) == {"documents", "tokens"}
    with pytest.raises(
        ValueError, match=r"--format chatml: not a format \(valid: text, prompt_completion, chat\)"
    ):
        prepare(tiny_tokenizer_dir, [data], tmp_path / "bad", fields=Fields("chatml"))
    with pytest.raises(
        ValueError, match=r"no field 'prompt' \(--prompt-field/--completion-field\)"
    ):
        prepare(tiny_tokenizer_dir, [data], tmp_path / "bad", fields=Fields("prompt_completion"))
    assert not (tmp_path / "bad").exists()


def _token_file(folder: Path, tokens: np.ndarray, mask: np.ndarray | None) -> Path:
    folder.mkdir()
    tokens.astype(np.uint16).tofile(folder / "train.bin")
    if mask is not None:
        mask.astype(np.uint8).tofile(folder / "train.mask.bin")
    return folder / "train.bin"


def test_a_mask_file_of_another_length_is_one_line_naming_both(tmp_path: Path):
    path = _token_file(tmp_path / "d", np.arange(100), np.ones(99))
    with pytest.raises(ValueError) as info:
        TokenFile(path, 8, 0)
    message = str(info.value)
    assert (
        "\n" not in message and f"{path.with_name('train.mask.bin')} holds 99 mask bytes" in message
    )
    assert f"{path} holds 100 tokens" in message


def test_the_mask_applies_to_the_predicted_token_and_unmasked_data_is_unchanged(tmp_path: Path):
    tokens, mask = np.arange(100) % 50, (np.arange(100) % 3 == 0)
    masked = TokenFile(_token_file(tmp_path / "m", tokens, mask), 8, 0)
    plain = TokenFile(_token_file(tmp_path / "p", tokens, None), 8, 0)
    assert masked.masked and not plain.masked
    inputs, targets = masked.pairs([16])
    assert inputs.tolist() == [list(range(16, 24))]
    # mask[17..24]
    assert targets.tolist() == [[t if t % 3 == 0 else IGNORE_INDEX for t in range(17, 25)]]
    assert torch.equal(plain.pairs([16])[1], torch.arange(17, 25)[None])


def _nano() -> torch.nn.Module:
    return build_model(_args_from_config(load_config(None, list(BASE)).model), device="cpu")


def test_a_global_batch_without_a_trained_token_is_loss_0_and_no_step(tmp_path: Path):
    model = _nano()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    source = TokenFile(_token_file(tmp_path / "d", np.arange(200) % 256, np.zeros(200)), 32, 0)
    batch = source.pairs([0, 32])
    loss, _ = _masked_causal_lm(model, batch)
    assert loss.item() == 0.0  # no NaN: a sum over nothing
    step = Step(
        model,
        optimizer,
        _masked_causal_lm,
        torch.device("cpu"),
        grad_clip=1.0,
        token_count=trained_tokens,
    )
    out = step.run([batch, source.pairs([64])])
    assert out.loss.item() == 0.0 and out.grad_norm.item() == 0.0 and out.verdict.finite
    # AdamW's decay did not move them
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert not optimizer.state
    assert _lm_sums(model, batch)[1].item() == 0  # validation counts none of it


def test_a_mask_file_under_another_task_is_an_error():
    cfg = dataclasses.replace(
        load_config(None, list(BASE)).model, task=Task.custom, loss="tests.user_model:nowhere"
    )
    with pytest.raises(ValueError, match="model.task=custom: the token file has a mask file"):
        build_task(cfg, masked=True)


def _hand_loss(initial: dict, root: Path, step: int, micro: int | None = None) -> float:
    """Step ``step``'s loss from the raw files: plain torch on the whole model at ``initial``, the windows
    of the global batch (the seeded order `fsdp_zero.data.batches._epoch_order` defines), targets masked by hand;
    ``micro``: the mean of micro-batch means instead (what a token-weighted loss must not be)."""
    cfg = load_config(None, [*BASE, *(a.format(root=root) for a in MASKED)])
    model = _nano()
    model.load_state_dict(initial)
    tokens = np.fromfile(root / "masked" / "train.bin", np.uint16).astype(np.int64)
    mask = np.fromfile(root / "masked" / "train.mask.bin", np.uint8)
    order = torch.randperm(64, generator=torch.Generator().manual_seed(cfg.train.seed))
    gbs, seq = cfg.train.global_batch_size, cfg.data.seq_len
    starts = [int(order[i]) * seq for i in range((step - 1) * gbs, step * gbs)]
    x = torch.tensor(np.stack([tokens[s : s + seq] for s in starts]))
    y = torch.tensor(np.stack([tokens[s + 1 : s + seq + 1] for s in starts]))
    keep = torch.tensor(np.stack([mask[s + 1 : s + seq + 1] for s in starts])).bool()
    with torch.no_grad():
        losses = F.cross_entropy(
            model(x).float().flatten(0, 1), y.flatten(), reduction="none"
        ).view_as(y)
    if micro:
        parts = [
            (losses[i : i + micro] * keep[i : i + micro]).sum() / keep[i : i + micro].sum()
            for i in range(0, gbs, micro)
        ]
        return float(torch.stack(parts).mean())
    return float((losses * keep).sum() / keep.sum())


def test_the_masked_loss_equals_a_hand_computation(batches):
    run, root = batches["masked"], batches.root
    hand = _hand_loss(run["initial"], root, 1)
    figure(
        "masked loss at step 1 against a hand computation (N = 2)",
        f"{abs(run['losses'][1] - hand):.2e} (loss {hand:.6f})",
    )
    assert abs(run["losses"][1] - hand) < 5e-6
    # what it must not be: the unweighted mean of micro-batch means (the pre-mask scaling), or all tokens
    assert abs(_hand_loss(run["initial"], root, 1, micro=2) - hand) > 1e-3
    losses, norms, weights = _against_reference(run, root)
    figure(
        "masked training against the single-process loop (N = 2, 8 steps)",
        f"losses {losses:.2e}, grad norms {norms:.2e}, weights {weights:.2e}",
    )
    assert losses < LOSS_ATOL and norms < NORM_ATOL and weights < WEIGHT_ATOL


def _against_reference(run: dict, root: Path, *overrides: str) -> tuple[float, float, float]:
    """The largest differences (losses, gradient norms, final weights) between a batched masked run and
    `tests.reference.reference_run` (an independent single-process loop: one mean over the global batch's
    trained tokens) of the same configuration, from the same initial weights."""
    cfg = load_config(None, [*BASE, *(a.format(root=root) for a in MASKED), *overrides])
    ref = reference_run(cfg, run["initial"])
    losses = max(abs(run["losses"][s] - ref["losses"][s]) for s in ref["losses"])
    # The gradient norm is the one figure that sees the gradient's scale: AdamW is invariant to a constant
    # scale, and BASE's clipping brings every step's norm to 0.5, so a gradient of the wrong magnitude leaves
    # the losses and weights of a clipped run as they were.
    norms = max(abs(run["grad_norms"][s] - ref["grad_norms"][s]) for s in ref["grad_norms"])
    weights = max((run["final"][k] - ref["final"][k]).abs().max().item() for k in ref["final"])
    return losses, norms, weights


def test_unclipped_masked_training_matches_the_single_process_loop(batches):
    """``masked-noclip`` (``masked`` with ``optim.grad_clip=0``) against the reference: the gradients' true
    norms, not norms that clipping made equal, and weights that followed unclipped gradients."""
    run, clipped = batches["masked-noclip"], batches["masked"]
    losses, norms, weights = _against_reference(run, batches.root, "optim.grad_clip=0")
    figure(
        "unclipped masked training against the single-process loop (N = 2, 8 steps)",
        f"losses {losses:.2e}, grad norms {norms:.2e}, weights {weights:.2e}",
    )
    assert losses < LOSS_ATOL and norms < NORM_ATOL and weights < WEIGHT_ATOL
    # the override reached the run: clipping at 0.5 was active in ``masked``, so its weights went elsewhere
    apart = max((run["final"][k] - clipped["final"][k]).abs().max().item() for k in run["final"])
    figure(
        "masked-noclip's final weights against masked's",
        f"{apart:.2e} (smallest clipped grad norm {min(clipped['grad_norms'].values()):.3f})",
    )
    assert min(clipped["grad_norms"].values()) > 0.5 and apart > 1e-4


@pytest.mark.parametrize("name", ["masked", "masked-n1"])
def test_validation_counts_only_the_trained_tokens(batches, name):
    run, root = batches[name], batches.root
    model = _nano()
    model.load_state_dict(run["final"])
    tokens = torch.from_numpy(
        np.fromfile(root / "masked" / "train.bin", np.uint16).astype(np.int64)
    )
    keep = torch.from_numpy(np.fromfile(root / "masked" / "train.mask.bin", np.uint8)).bool()
    total, count = 0.0, 0
    with torch.no_grad():
        # window k: tokens [32 k, 32 k + 33), its targets' mask bytes 32 k + 1 ..
        for k in range(64):
            x, y, m = (
                tokens[32 * k : 32 * k + 32],
                tokens[32 * k + 1 : 32 * k + 33],
                keep[32 * k + 1 : 32 * k + 33],
            )
            losses = F.cross_entropy(model(x[None])[0].double(), y, reduction="none")
            total, count = total + losses[m].sum().item(), count + int(m.sum())
    got = run["evals"][8]["eval/loss"]
    figure(
        f"masked eval/loss against a hand computation ({name})", f"{abs(got - total / count):.2e}"
    )
    assert abs(got - total / count) < 1e-5


@pytest.mark.parametrize("other", ["masked-n1", "masked-n1-mb8"])
def test_the_masked_loss_is_the_same_at_one_and_two_ranks_and_any_micro_batch(batches, other):
    two, one = batches["masked"], batches[other]
    assert all(torch.equal(two["initial"][k], one["initial"][k]) for k in two["initial"])
    losses = max(abs(two["losses"][s] - one["losses"][s]) for s in two["losses"])
    norms = max(abs(two["grad_norms"][s] - one["grad_norms"][s]) for s in two["grad_norms"])
    weights = max((two["final"][k] - one["final"][k]).abs().max().item() for k in two["final"])
    figure(
        f"masked training, N = 2 micro-batch 2 against {other}",
        f"losses {losses:.2e}, grad norms {norms:.2e}, weights {weights:.2e}",
    )
    assert losses < LOSS_ATOL and norms < NORM_ATOL and weights < WEIGHT_ATOL


LAYOUT_WORDS = {
    "masked-tp2": "dp 2 x tp 2",
    "masked-pp2": "pp 2 x dp 2",
    "masked-sp2": "dp 2 x sp 2",
}


@pytest.mark.parametrize("name", list(LAYOUT_WORDS))
def test_tp_pp_and_sp_count_the_trained_tokens_over_the_loss_ranks(batches, name):
    """dp 2 x tp 2, pp 2 x dp 2 and dp 2 x sp 2 read ``masked``'s batches (a tensor-parallel pair,
    or a pipeline's two stages, read one; a sequence-parallel pair a half of each of its
    sequences, the trained tokens of each half differing): the same token weighting over every
    trained token of the global batch, so the same losses, gradient norms and weights, and the
    same validation loss."""
    got, two = batches[name], batches["masked"]
    losses = max(abs(got["losses"][s] - two["losses"][s]) for s in two["losses"])
    norms = max(abs(got["grad_norms"][s] - two["grad_norms"][s]) for s in two["grad_norms"])
    weights = max((got["final"][k] - two["final"][k]).abs().max().item() for k in two["final"])
    evals = abs(got["evals"][8]["eval/loss"] - two["evals"][8]["eval/loss"])
    figure(
        f"masked training, {LAYOUT_WORDS[name]} against N = 2",
        f"losses {losses:.2e}, grad norms {norms:.2e}, weights {weights:.2e}, eval/loss {evals:.2e}",
    )
    assert losses < LOSS_ATOL and norms < NORM_ATOL and weights < WEIGHT_ATOL and evals < 1e-5


@pytest.mark.parametrize(
    "case, extra, message",
    [
        (
            "no template",
            ("--format", "chat"),
            "--format chat: the tokenizer (.*) has no chat template",
        ),
        (
            "a .txt",
            ("--format", "prompt_completion"),
            r"--format prompt_completion reads records \(\.jsonl, .*\), not \.txt files",
        ),
        (
            "not messages",
            ("--format", "chat", "--field", "text"),
            r"field 'text' must be a non-empty list of",
        ),
    ],
)
def test_bad_instruction_inputs_are_one_line_and_exit_2(
    tmp_path: Path, tiny_tokenizer_dir: Path, case, extra, message
):
    from tests.test_prepare import _refused

    if case == "a .txt":
        data = tmp_path / "d.txt"
        data.write_text("some text")
    else:
        data = _write_jsonl(
            tmp_path / "d.jsonl", [{"text": "hi", "messages": [{"role": "user", "content": "hi"}]}]
        )
    line = _refused(tiny_tokenizer_dir, tmp_path, str(data), extra=extra)
    assert re.search(message, line), line
