"""The fine-tuning walkthrough (docs/fine-tuning.md), its three commands run as written.

From a temporary folder holding a Hugging Face model folder (`models/base`: the tests' tiny Llama and
its tokenizer, tests/hf_fixtures.py) and a folder of text (`texts/`: .txt files and a .jsonl):
prepare_data.py writes `data/mine`; torchrun trains 2 ranks with `configs/finetune.yaml` (plus the
overrides that shrink it to the tiny model: its context is 64 tokens) and the validation loss;
export.py writes `models/finetuned`. `from_pretrained` on that folder, in this process, gives the
validation loss the run logged last (within bf16's rounding: the config trains in bf16-mixed, as shipped),
and its tokenizer reads the prepared tokens back.

Covers: fsdp_zero/model/hf.py, fsdp_zero/checkpoint/export.py, fsdp_zero/data/prepare.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from fsdp_zero.config import RunDir
from tests.batches import HAS_HF
from tests.conftest import REPO, check, figure, launch, run_script
from tests.hf_fixtures import sample_text, tiny_llama

pytestmark = pytest.mark.skipif(not HAS_HF, reason="needs the hf extra (transformers)")

# The walkthrough's commands, as docs/fine-tuning.md prints them (run from the repository's root there).
PREPARE = "python scripts/prepare_data.py --tokenizer models/base --input texts/ --out data/mine"
TRAIN = "torchrun --nproc_per_node=2 scripts/train.py --config configs/finetune.yaml"
EXPORT = "python scripts/export.py runs/finetune/checkpoints/step-0000008 --out models/finetuned"
# configs/finetune.yaml sized down for the tiny model (the docs show the same run); its precision as shipped,
# bf16-mixed (gathered and computed in bf16, stored and reduced in fp32).
TINY = (
    "data.seq_len=32",
    "train.steps=8",
    "train.global_batch_size=4",
    "train.micro_batch_size=1",
    "train.log_every=2",
    "eval.every=4",
    "checkpoint.every=4",
    "optim.lr=1e-3",
    "optim.warmup_steps=2",
)
# from_pretrained's fp32 validation loss against the run's bf16-mixed eval/loss: the same fp32 weights, the
# run's forward in bf16 (8 bits of mantissa: each logit off by about 2^-9 of its size, ~1e-2 on a token's loss,
# averaged over the 160 tokens to ~1e-3; measured 7.8e-5).
BF16_LOSS_ATOL = 2e-3


def _args(command: str) -> list[str]:
    """The command's arguments after its script, with repository paths made absolute."""
    words = command.split()
    start = next(i for i, w in enumerate(words) if w.startswith("scripts/")) + 1
    return [str(REPO / w) if w.startswith("configs/") else w for w in words[start:]]


def yaml_precision() -> str:
    """configs/finetune.yaml's precision.mode, as shipped."""
    import yaml

    return yaml.safe_load((REPO / "configs" / "finetune.yaml").read_text())["precision"]["mode"]


def _val_loss(folder: Path, tokens: np.ndarray, seq_len: int) -> float:
    """The token-weighted mean next-token loss over windows of seq_len + 1 tokens at stride seq_len."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    t = torch.from_numpy(tokens.astype(np.int64))
    windows = torch.stack(
        [t[k * seq_len : k * seq_len + seq_len + 1] for k in range((len(t) - 1) // seq_len)]
    )
    with torch.no_grad():
        logits = model(windows[:, :-1]).logits
    return torch.nn.functional.cross_entropy(
        logits.flatten(0, 1).float(), windows[:, 1:].flatten()
    ).item()


def test_the_walkthrough_runs_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from transformers import AutoTokenizer

    page = (REPO / "docs" / "fine-tuning.md").read_text()
    for command in (PREPARE, TRAIN, EXPORT):
        assert command in page, f"docs/fine-tuning.md no longer shows: {command}"
    assert " ".join(TINY) in page  # the sized-down run the page shows
    tiny_llama(tmp_path / "models" / "base")
    rng = random.Random(1)
    (tmp_path / "texts").mkdir()
    docs = [sample_text(rng, 120) for _ in range(12)]
    for i, text in enumerate(docs):
        (tmp_path / "texts" / f"doc{i:02d}.txt").write_text(text)
    (tmp_path / "texts" / "more.jsonl").write_text(
        "".join(json.dumps({"text": sample_text(rng, 80)}) + "\n" for _ in range(28))
    )

    monkeypatch.chdir(tmp_path)
    check(run_script(REPO / "scripts" / "prepare_data.py", *_args(PREPARE), cwd=tmp_path))
    proc = check(launch(2, REPO / "scripts" / "train.py", *_args(TRAIN), *TINY, cwd=tmp_path))
    assert "eval/loss" in proc.stdout + proc.stderr
    check(run_script(REPO / "scripts" / "export.py", *_args(EXPORT), cwd=tmp_path))

    meta = json.loads(Path("data/mine/meta.json").read_text())
    val = np.fromfile("data/mine/val.bin", dtype=meta["dtype"])
    logged = [row for row in RunDir(Path("runs/finetune")).metric_rows() if "eval/loss" in row]
    assert [row["step"] for row in logged] == [4, 8]
    # the config as shipped
    assert yaml_precision() == "bf16-mixed" and "precision" not in " ".join(TINY)
    assert json.loads(Path("runs/finetune/summary.json").read_text())["precision"] == "bf16-mixed"
    ours = _val_loss(Path("models/finetuned"), val, 32)
    assert ours == pytest.approx(logged[-1]["eval/loss"], abs=BF16_LOSS_ATOL)
    figure(
        "fine-tuning walkthrough: from_pretrained's validation loss vs the run's last eval/loss",
        f"{abs(ours - logged[-1]['eval/loss']):.1e} ({ours:.6f})",
    )
    tokenizer = AutoTokenizer.from_pretrained("models/finetuned")
    train = np.fromfile("data/mine/train.bin", dtype=meta["dtype"])
    first = train[: int(np.argmax(train == meta["eos_id"]))]
    assert tokenizer.decode(first, skip_special_tokens=True) in docs + [
        json.loads(line)["text"] for line in Path("texts/more.jsonl").read_text().splitlines()
    ]
