"""The suite's launches: one per world size (and per resume), each with the files its runs read,
made first in the test process (token files, bases, imported checkpoints)."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.batches.settings import (
    BASE,
    DS_CONTINUED,
    DS_RUNS,
    EVAL_TOKENS,
    HAS_HF,
    MASKED_TOKENS,
    QLORA_BASE_SEED,
    QWEN3_MOE_CONFIG,
    L,
    Launch,
    Q,
    ds_settings,
)
from tests.conftest import _COLLECTED, REPO, build_model, check


def _weights_to_import(root: Path) -> None:
    """n2's final weights as a torch.save state dict and as an exported safetensors folder (when this
    session ran n2: only the checkpoint tests import them)."""
    from fsdp_zero.checkpoint.weights import export_checkpoint
    from fsdp_zero.config.loader import load_config
    from fsdp_zero.model.transformer import _args_from_config

    if not (root / "n2.pt").exists():
        return
    model = build_model(_args_from_config(load_config(None, list(BASE)).model), device="cpu")
    model.load_state_dict(torch.load(root / "n2.pt", weights_only=True)["final"])
    torch.save(model.state_dict(), root / "weights.pt")
    export_checkpoint(
        root / "n2" / "checkpoints" / "step-0000008", root / "exported", max_shard_bytes=100_000
    )


def _hf_folder(root: Path) -> None:
    """The tiny Hugging Face folder that model.pretrained reads (when test_pretrained runs)."""
    if HAS_HF and {"test_pretrained", L, Q} & _COLLECTED and not (root / "tiny-llama").exists():
        from tests.hf_fixtures import tiny_llama

        tiny_llama(root / "tiny-llama")


def _eval_tokens(root: Path) -> None:
    """The held-out token file the eval runs read: seeded uint16 ids below gpt_nano's vocabulary of 256."""
    if not (root / "val.bin").exists():
        torch.randint(
            0, 256, (EVAL_TOKENS,), generator=torch.Generator().manual_seed(19), dtype=torch.int32
        ).numpy().astype("uint16").tofile(root / "val.bin")


def _masked_tokens(root: Path) -> None:
    """The masked token file: seeded uint16 ids below gpt_nano's 256; its mask 0 on each document's
    first 60% (the prompt), 1 on the rest (the completion and its EOS), 0 on window 10's targets."""
    folder = root / "masked"
    if (folder / "train.mask.bin").exists():
        return
    folder.mkdir(exist_ok=True)
    gen = torch.Generator().manual_seed(20)
    torch.randint(0, 256, (MASKED_TOKENS,), generator=gen, dtype=torch.int32).numpy().astype(
        "uint16"
    ).tofile(folder / "train.bin")
    mask, done = torch.zeros(MASKED_TOKENS, dtype=torch.uint8), 0
    while done < MASKED_TOKENS:
        length = int(torch.randint(8, 60, (1,), generator=gen))
        mask[done + int(0.6 * length) : done + length] = 1
        done += length
    mask[10 * 32 + 1 : 11 * 32 + 1] = 0  # window 10 predicts tokens 321..352: none trained
    mask.numpy().tofile(folder / "train.mask.bin")


def _qlora_bases(root: Path) -> None:
    """The QLoRA runs' base: gpt_nano initialised by the build for seed 5 (not the runs' seed), as a
    torch.save state dict; and the same with one weight nudged by one bf16 step (the base a resume
    must refuse)."""
    folder = root / "bases"  # (a run's results are <root>/<run name>.pt)
    if (folder / "qlora-nudged.pt").exists():
        return
    folder.mkdir(exist_ok=True)
    from fsdp_zero.config.loader import load_config
    from fsdp_zero.model.construct import construct, real_buffers
    from fsdp_zero.sharding.build import materializer

    cfg = load_config(None, list(BASE))
    model = construct(cfg.model)
    materializer(torch.device("cpu"), cfg.model.init, QLORA_BASE_SEED, real_buffers(model), [])(
        model
    )
    state = model.state_dict()
    torch.save(state, folder / "qlora.pt")
    state["layers.1.attention.wk.weight"][0, 0] += 0.05
    torch.save(state, folder / "qlora-nudged.pt")


def _one_expert_base(root: Path) -> None:
    """moe_nano at top 1 initialised by the build for the runs' seed, its routers' weights zero:
    every token's scores tie, and the first expert takes them all (tests/test_experts.py)."""
    path = root / "bases" / "moe-one-expert.pt"
    if path.exists() or "test_experts" not in _COLLECTED:
        return
    path.parent.mkdir(exist_ok=True)
    from fsdp_zero.config.loader import load_config
    from fsdp_zero.model.construct import construct, real_buffers
    from fsdp_zero.sharding.build import materializer

    cfg = load_config(None, [*BASE, "model.preset=moe_nano", "model.experts_top_k=1"])
    model = construct(cfg.model)
    materializer(torch.device("cpu"), cfg.model.init, cfg.train.seed, real_buffers(model), [])(
        model
    )
    state = model.state_dict()
    for name in state:
        if name.endswith("router.gate.weight"):
            state[name].zero_()
    torch.save(state, path)


def _hub_moe(root: Path) -> None:
    """The tiny Qwen3-MoE folder the mixture's pretrained run starts from: seeded weights saved by
    transformers' save_pretrained (the Hub's format: each expert's Linears apart)."""
    if not HAS_HF or "test_experts" not in _COLLECTED or (root / "qwen3-moe").exists():
        return
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(23)
    Qwen3MoeForCausalLM(Qwen3MoeConfig(**QWEN3_MOE_CONFIG)).save_pretrained(root / "qwen3-moe")


def _ds_imports(root: Path, ranks: int) -> None:
    """scripts/import_deepspeed.py of each DeepSpeed checkpoint continued at ``ranks`` ranks (in this
    process; when tests/test_ds_import.py runs)."""
    if "test_ds_import" not in _COLLECTED:
        return
    from tests.conftest import run_script

    for name, (case, n) in DS_CONTINUED.items():
        if n == ranks:
            check(
                run_script(
                    REPO / "scripts" / "import_deepspeed.py",
                    str(DS_RUNS / case),
                    "--run-dir",
                    str(root / name),
                    *ds_settings(case, ranks),
                )
            )


def _resume2_files(root: Path) -> None:
    _weights_to_import(root)
    _ds_imports(root, 2)


def _launch2_files(root: Path) -> None:
    _qlora_bases(root)
    _one_expert_base(root)
    _hub_moe(root)
    _hf_folder(root)
    _eval_tokens(root)
    _masked_tokens(root)


def _launch1_files(root: Path) -> None:
    _eval_tokens(root)
    _masked_tokens(root)


LAUNCHES = {
    "2": Launch(2, prepare=_launch2_files),
    "2-resume": Launch(2, after=("2",), prepare=_resume2_files),
    "4": Launch(4, after=("2",)),
    "4-resume": Launch(4, after=("4", "2-resume"), prepare=lambda root: _ds_imports(root, 4)),
    "1": Launch(0, after=("2",), prepare=_launch1_files),
    "3": Launch(3),
}
