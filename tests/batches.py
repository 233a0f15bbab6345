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
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tests.conftest import _COLLECTED, REPO, build_model, check, launch

WORKER = REPO / "tests" / "workers" / "jobs.py"
# the `hf` extra (in `dev`): the llama runs
HAS_HF = importlib.util.find_spec("transformers") is not None

# tests/test_parity.py's base: 8 AdamW steps, clipping active on every step (asserted there). Without the
# memory tracker's profiled step (about 0.7 s a run): the runs whose tracker figures a test reads profile step 2.
BASE = (
    "model.preset=gpt_nano",
    "data.seq_len=32",
    "train.global_batch_size=8",
    "train.micro_batch_size=2",
    "train.steps=8",
    "train.log_every=1",
    "optim.warmup_steps=2",
    "optim.grad_clip=0.5",
    "metrics.tensorboard=false",
    "memory.profile_step=0",
)
# tests/test_parity.py: the activations and gathered parameters after forward
PROFILED = ("memory.profile_step=2",)
TIED = ("model.tie_embeddings=true",)
# tests/test_models.py's: foreign models, 4 steps, a constant learning rate without weight decay.
COMMON = (
    "train.steps=4",
    "train.log_every=1",
    "checkpoint.every=2",
    "checkpoint.keep_last=0",
    "metrics.tensorboard=false",
    "memory.profile_step=0",
    "optim.weight_decay=0",
    "optim.warmup_steps=0",
    "optim.min_lr_ratio=1",
)
# a torchvision VisionTransformer on FakeData, units EncoderBlock
VIT = ("--config", "configs/vit_fake.yaml")
LLAMA = (
    "model.target=transformers:LlamaForCausalLM",
    "model.kwargs.vocab_size=101",
    "model.kwargs.hidden_size=32",
    "model.kwargs.intermediate_size=64",
    "model.kwargs.num_hidden_layers=2",
    "model.kwargs.num_attention_heads=4",
    "model.kwargs.num_key_value_heads=2",
    "model.kwargs.max_position_embeddings=64",
    "model.kwargs.tie_word_embeddings=true",
    "data.seq_len=16",
)  # units: _no_split_modules
# the llama under tensor parallelism: untied, an even vocabulary (the embedding splits its rows)
UNTIED_EVEN = ("model.kwargs.tie_word_embeddings=false", "model.kwargs.vocab_size=102")
SPLIT = "{root}/split/checkpoints/step-0000004"  # ZeRO-3 at 2 ranks, saved after step 4 of 8
QLORA_4 = "{root}/qlora/checkpoints/step-0000004"
ADAMW8_4 = "{root}/adamw8/checkpoints/step-0000004"
FP8_4 = "{root}/fp8-tw/checkpoints/step-0000004"
# tests/test_eval.py's validation: 5 windows of 33 tokens (170 tokens: a tail no window reaches), after
# steps 3, 6 and 8; at 2 ranks and micro-batch 2, rank 0 forwards 2 + 1 windows, rank 1 2 and a dummy.
EVAL = ("eval.every=3", "eval.path={root}/val.bin")
EVAL_TOKENS = 170
TP2 = "parallel.tp_size=2"
# pipeline parallelism: two stages (gpt_nano's two layers, one each; four under the V schedule)
PP2 = "parallel.pp_size=2"
FOUR_LAYERS = ("model.n_layers=4",)
HSDP_MB1 = ("parallel.strategy=hybrid_shard", "parallel.shard_size=2", "train.micro_batch_size=1")


@dataclass(frozen=True)
class Run:
    name: str
    launch: str
    args: tuple[str, ...]
    readers: tuple[str, ...]  # the test modules that read it
    run_name: str = ""  # the run directory under the launch root (default: name)
    options: dict = field(default_factory=dict)  # tests/workers/jobs.py's per-job options


@dataclass(frozen=True)
class Launch:
    nproc: int  # 0: plain python (world size 1)
    after: tuple[str, ...] = ()  # launches whose checkpoints its runs read
    # files its runs read, made first in the test process
    prepare: Callable[[Path], None] | None = None


P, C, M, E, L = "test_parity", "test_checkpoint", "test_models", "test_eval", "test_lora"
T, S, K = "test_comm", "test_step_group", "test_clusters"
Q, B, F = "test_qlora", "test_lowbit_adamw", "test_float8"
# tests/test_lora.py's: the embedding and layer 0's attention frozen; LoRA on three Linear kinds with the final norm
# trained.
FREEZE = (r"model.freeze=[tok_embeddings.weight,layers\.0\.attention\..*]",)
LORA = ("model.lora.rank=4", "model.lora.targets=[wq,wv,w2]", "model.lora.train=[norm.weight]")
# tests/test_step_group.py's bounded optimizer step: groups of at most 5,000 local elements (gpt_nano's
# ~70k a rank at 2 ranks: 13 groups under FSDP, a 64 x 64 matrix's 2,048-element shards two to a group).
GROUPED = ("optim.step_group_size=5000",)
# tests/test_qlora.py's: LoRA's settings on a pretrained base (a seeded gpt_nano saved as a state dict),
# every block Linear stored in NF4. Scaler blocks of 16 (not 256): gpt_nano's 64 x 64 matrices then
# split into whole blocks of 64 x 16 elements at 2 and 4 ranks.
QLORA = (
    *LORA,
    "model.lora.quantize=nf4",
    "model.lora.nf4_scaler_block_size=16",
    "model.init_from={root}/bases/qlora.pt",
)
QLORA_BASE_SEED = 5
# tests/test_lowbit_adamw.py's: only the feed-forward's w1 and w3 (96 x 64 shards at 2 ranks: 6,144 values,
# packed) and the attention's wq (2,048: fp32 states) train
# tests/test_float8.py's: bf16-mixed, the feed-forwards as FSDP units of their own (three float8 Linears
# and nothing else: the all-gather that gloo cannot send without ByteAllGather)
BF16 = ("precision=bf16-mixed",)
# gpt_nano's Linear modules inside its block units (what NF4 and float8 take by default)
BLOCK_LINEARS = [
    f"layers.{i}.{m}"
    for i in range(2)
    for m in ("attention.wq", "attention.wk", "attention.wv", "attention.wo")
    + ("feed_forward.w1", "feed_forward.w2", "feed_forward.w3")
]
FF_UNITS = ("parallel.wrap.policy=modules", r"parallel.wrap.modules=[layers\.\d+\.feed_forward]")
LOW_BIT = (
    r"model.freeze=[tok_embeddings.weight,output.weight,.*norm.*,.*\.(wk|wv|wo|w2)\.weight]",
)


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


# tests/test_masked.py's instruction data: 64 windows of 33 tokens (every window read once in 8 steps of 8),
# a mask file beside it (documents: a prompt left out, a completion trained on) and window 10 all prompt;
# validation on the same file after the last step (its 64 windows in file order).
MASKED = (
    "data.source=tokens",
    "data.path={root}/masked/train.bin",
    "eval.every=8",
    "eval.path={root}/masked/train.bin",
)
MASKED_TOKENS = 64 * 32 + 1


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


# tests/test_ds_import.py's: real DeepSpeed runs (tests/deepspeed_runs/make.py) imported, then continued
# here at 2 and 4 ranks with their own ds_config.json, model and data; run -> (DeepSpeed's case, ranks).
DS_RUNS = REPO / "tests" / "deepspeed_runs"
DS_CONTINUED = {
    "ds-zero1": ("zero1", 2),
    "ds-zero1-bf16": ("zero1-bf16", 2),
    # ZeRO-3: a user's GPT (LayerNorms and biases, all decayed: optim.decay_1d) at 2 ranks, saved inside
    # its warm-up, continued at 2 and at 4. (The built-in model's ZeRO-3 runs, at 2 ranks and at 3 with
    # padded partitions, ZeRO-2's and the universal form's are imported bit for bit into the same whole
    # tensors and their schedules checked step by step: none is continued again.)
    "ds-user-gpt": ("user-gpt", 2),
    "ds-user-gpt-n4": ("user-gpt", 4),
}


def ds_settings(case: str, ranks: int) -> list[str]:
    """What scripts/train.py --deepspeed ds_config.json gives at ``ranks`` ranks, with DeepSpeed's model
    and data overrides (WarmupLR has no length of its own: 8 steps, as DeepSpeed ran; bf16's ZeRO-1 runs as
    ZeRO-2 here)."""
    from fsdp_zero.config.deepspeed import read_deepspeed

    folder = DS_RUNS / case.removesuffix("-universal")
    mapped, _ = read_deepspeed(folder / "ds_config.json", ranks)
    record = json.loads((folder / "run.json").read_text())
    # our ZeRO-1 (DDP with a sharded optimizer) takes fp32 or bf16-true: bf16-mixed continues under ZeRO-2
    bf16 = ["parallel.zero_stage=2"] if case.endswith("-bf16") else []
    return [*mapped, *record["overrides"], f"train.steps={len(record['losses'])}", *bf16]


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

RUNS = [
    # ZeRO-3 straight through, saving every 2 steps (retention keeps 6 and 8): the parity run and the
    # checkpoint tests' straight run.
    Run(
        "n2",
        "2",
        (*BASE, *PROFILED, "checkpoint.every=2", "checkpoint.keep_last=2"),
        (P, C, "test_cli", E, T, S, K),
    ),
    # n2 with validation (and TensorBoard on, to read eval/* back): the same training losses, bit for bit.
    Run(
        "eval",
        "2",
        (*BASE, "checkpoint.every=2", "checkpoint.keep_last=2", *EVAL, "metrics.tensorboard=true"),
        (E, T, P),
    ),
    Run("n2-tied", "2", (*BASE, *TIED), (P, T)),
    # DDP and ZeRO-2 evaluate too: DDP through its wrapper, ZeRO-2's units left gathered by a forward without
    # backward until FSDP2's reset_iter_state (tests/test_eval.py).
    Run("ddp", "2", (*BASE, "parallel.strategy=ddp", "checkpoint.every=4", *EVAL), (P, C, T, E)),
    # DeepSpeed's name for it
    Run("zero1", "2", (*BASE, "parallel.zero_stage=1", "checkpoint.every=4"), (P, C, T, S)),
    # FSDP1's name for it
    Run("zero2", "2", (*BASE, *PROFILED, "parallel.strategy=SHARD_GRAD_OP", *EVAL), (P, T, E)),
    # The memory levers: plain ZeRO-3's numbers bit for bit; CPU offload and full checkpointing share a run.
    Run(
        "ac-full",
        "2",
        (*BASE, *PROFILED, "parallel.activation_checkpointing=full", "parallel.cpu_offload=true"),
        (P,),
    ),
    Run(
        "ac-selective",
        "2",
        (
            *BASE,
            *PROFILED,
            "parallel.activation_checkpointing=selective",
            "parallel.activation_checkpointing_every=2",
        ),
        (P,),
    ),
    Run("bf16-mixed", "2", (*BASE, *PROFILED, "precision=bf16-mixed"), (P, T, S, F)),
    Run("fp16-mixed", "2", (*BASE, "precision=fp16-mixed"), (P,)),
    Run("bf16-true", "2", (*BASE, *PROFILED, "precision=bf16-true"), (P, T)),
    Run(
        "overflow",
        "2",
        (
            *BASE,
            "precision=fp16-mixed",
            "model.task=custom",
            "model.loss=tests.user_model:overflow_on_rank1",
        ),
        (P,),
    ),
    Run(
        "split", "2", (*BASE, "train.stop_after=4", "checkpoint.every=0"), (C, S, T)
    ),  # T: full_shard-to-ddp-n4 reads it
    Run(
        "async",
        "2",
        (*BASE, "checkpoint.async_save=true", "checkpoint.every=2", "checkpoint.keep_last=2"),
        (C,),
        options={"slow_writes": 0.3},
    ),
    Run("vit", "2", (*VIT, *COMMON), (M,)),
    Run("llama", "2", (*LLAMA, *COMMON), (M,)),
    # The ViT with the default optimizer: weight decay on matrices only, warm-up and cosine decay.
    Run(
        "vit-defaults",
        "2",
        (
            *VIT,
            "train.steps=4",
            "train.log_every=1",
            "checkpoint.enabled=false",
            "metrics.tensorboard=false",
            "memory.profile_step=0",
            "optim.warmup_steps=2",
        ),
        (M,),
    ),
    Run(
        "pretrained",
        "2",
        ("model.pretrained={root}/tiny-llama", "data.seq_len=16", *COMMON),
        ("test_pretrained",),
    ),
    # Masked instruction data (tests/test_masked.py): the token-weighted loss at N = 2, micro-batch 2.
    Run("masked", "2", (*BASE, *MASKED), ("test_masked",)),
    # The same without clipping: AdamW's steps then follow the gradient's scale, which clipping hides.
    Run("masked-noclip", "2", (*BASE, *MASKED, "optim.grad_clip=0"), ("test_masked",)),
    Run("freeze", "2", (*BASE, *FREEZE), (L, T)),
    Run("lora", "2", (*BASE, *LORA), (L, T)),
    # LoRA on a Hugging Face folder's Llama (q_proj, v_proj): the base weights loaded, then the exports.
    Run(
        "pretrained-lora",
        "2",
        (
            "model.pretrained={root}/tiny-llama",
            "data.seq_len=16",
            *COMMON,
            "model.lora.rank=4",
            "model.lora.targets=[q_proj,v_proj]",
        ),
        (L,),
    ),
    Run("lora-split", "2", (*BASE, *LORA, "train.stop_after=4", "checkpoint.every=0"), (L,)),
    # QLoRA: saved at 4 and 8; in bf16-mixed (2 steps)
    Run("qlora", "2", (*BASE, *QLORA, "checkpoint.every=4"), (Q,)),
    Run("qlora-bf16", "2", (*BASE, *QLORA, "precision=bf16-mixed", "train.steps=2"), (Q,)),
    # float8 (emulated) against bf16-mixed: tensorwise (float8 all-gather) and its bf16 twin, rowwise
    # against the bf16-mixed run
    Run(
        "fp8-tw",
        "2",
        (*BASE, *BF16, *FF_UNITS, "precision.float8=tensorwise", "checkpoint.every=4"),
        (F,),
    ),
    Run("fp8-bf16-ff", "2", (*BASE, *BF16, *FF_UNITS, "checkpoint.enabled=false"), (F,)),
    Run(
        "fp8-rw", "2", (*BASE, *BF16, "precision.float8=rowwise", "checkpoint.enabled=false"), (F,)
    ),
    Run("fp8-mx", "2", (*BASE, *BF16, "precision.float8=mxfp8", "checkpoint.enabled=false"), (F,)),
    # torchao's low-bit AdamW states against torch's AdamW, two shard shapes trained (each process
    # compiles torchao's update once per shape: seconds each)
    Run("adamw32", "2", (*BASE, *LOW_BIT, "checkpoint.enabled=false"), (B,)),
    Run("adamw8", "2", (*BASE, *LOW_BIT, "optim.state_bits=8", "checkpoint.every=4"), (B,)),
    Run("adamw4", "2", (*BASE, *LOW_BIT, "optim.state_bits=4", "checkpoint.enabled=false"), (B,)),
    # configs/qlora.yaml as shipped (bf16-mixed, activation checkpointing, every projection adapted and
    # in NF4) on the tiny Llama folder, synthetic data, 4 steps; scaler blocks of 4 (its k_proj is 16 x 32)
    Run(
        "qlora-llama",
        "2",
        (
            "--config",
            "configs/qlora.yaml",
            "model.pretrained={root}/tiny-llama",
            *("data.source=synthetic", "data.path=null", "eval.every=0", "eval.path=null"),
            *("data.seq_len=16", "train.steps=4", "train.global_batch_size=8"),
            *("train.micro_batch_size=2", "optim.warmup_steps=0", "checkpoint.every=4"),
            "model.lora.nf4_scaler_block_size=4",
        ),
        (Q,),
    ),
    # parallel.grad_sync=once_per_step (tests/test_comm.py): n2's numbers, half its reduce-scatter bytes.
    Run("grad-once", "2", (*BASE, "parallel.grad_sync=once_per_step"), (T,)),
    # ... under ZeRO-2 in bf16-true: bf16-true's numbers (its gradients accumulated unsharded, in bf16).
    Run(
        "grad-once-zero2-bf16",
        "2",
        (
            *BASE,
            "parallel.strategy=shard_grad_op",
            "precision=bf16-true",
            "parallel.grad_sync=once_per_step",
        ),
        (T,),
    ),
    # n2, bf16-mixed and zero1 with the optimizer stepped group by group: the same bits.
    Run("group", "2", (*BASE, *GROUPED, "checkpoint.every=4"), (S,)),
    Run("group-bf16", "2", (*BASE, *GROUPED, "precision=bf16-mixed"), (S,)),
    Run("group-zero1", "2", (*BASE, *GROUPED, "parallel.zero_stage=1", "checkpoint.every=4"), (S,)),
    # Pipeline parallelism, 1F1B: two stages, one a rank, 4 micro-batches; zero bubble (a V of four
    # stages, two a rank) on the four-layer model
    Run("pp2", "2", (*BASE, PP2), (P,)),
    Run("pp2-zbv", "2", (*BASE, *FOUR_LAYERS, PP2, "parallel.pp_schedule=ZBVZeroBubble"), (P,)),
    Run("compile", "2", (*BASE, "train.compile=true"), (P,)),  # ~25 s of inductor: last
    # Each continues a checkpoint of launch "2" in a fresh process.
    Run("resumed", "2-resume", (*BASE, "checkpoint.every=0"), (C,), run_name="split"),
    Run(
        "fp8-tw-resumed",
        "2-resume",
        (
            *BASE,
            *BF16,
            *FF_UNITS,
            "precision.float8=tensorwise",
            "checkpoint.every=0",
            f"checkpoint.resume={FP8_4}",
        ),
        (F,),
    ),
    Run(
        "adamw8-resumed",
        "2-resume",
        (
            *BASE,
            *LOW_BIT,
            "optim.state_bits=8",
            "checkpoint.every=0",
            f"checkpoint.resume={ADAMW8_4}",
        ),
        (B,),
    ),
    # qlora continued from step 4 in a new process (the base rebuilt from its file), and refused with
    # another base
    Run(
        "qlora-resumed",
        "2-resume",
        (*BASE, *QLORA, "checkpoint.every=0", f"checkpoint.resume={QLORA_4}"),
        (Q,),
    ),
    Run(
        "qlora-other-base",
        "2-resume",
        (
            *BASE,
            *QLORA,
            "model.init_from={root}/bases/qlora-nudged.pt",
            f"checkpoint.resume={QLORA_4}",
        ),
        (Q,),
        options={"expect_error": True},
    ),
    Run(
        "zero1-resumed",
        "2-resume",
        (
            *BASE,
            "parallel.zero_stage=1",
            "checkpoint.every=0",
            "checkpoint.resume={root}/zero1/checkpoints/step-0000004",
        ),
        (C,),
    ),
    Run(
        "overflow-resumed",
        "2-resume",
        (
            *BASE,
            "precision=fp16-mixed",
            "model.task=custom",
            "train.steps=10",
            "model.loss=tests.user_model:overflow_on_rank1",
        ),
        (P,),
        run_name="overflow",
    ),
    Run(
        "llama-resumed",
        "2-resume",
        (*LLAMA, *COMMON, "checkpoint.resume={root}/llama/checkpoints/step-0000002"),
        (M,),
    ),
    Run(
        "pretrained-resumed",
        "2-resume",
        (
            "model.pretrained={root}/tiny-llama",
            "data.seq_len=16",
            *COMMON,
            "checkpoint.resume={root}/pretrained/checkpoints/step-0000002",
        ),
        ("test_pretrained",),
    ),
    Run(
        "lora-resumed",
        "2-resume",
        (*BASE, *LORA, "checkpoint.every=0"),
        (L,),
        run_name="lora-split",
    ),
    # A checkpoint saved reducing every micro-batch, continued deferring: n2's steps 5-8 (grad_sync is no part of it).
    Run(
        "grad-once-resumed",
        "2-resume",
        (
            *BASE,
            "parallel.grad_sync=once_per_step",
            "checkpoint.every=0",
            f"checkpoint.resume={SPLIT}",
        ),
        (T,),
    ),
    # A checkpoint saved whole-shard continued in groups, and one saved in groups continued whole-shard.
    Run(
        "group-resumed",
        "2-resume",
        (
            *BASE,
            *GROUPED,
            "checkpoint.every=0",
            "checkpoint.resume={root}/split/checkpoints/step-0000004",
        ),
        (S,),
    ),
    Run(
        "group-to-whole",
        "2-resume",
        (*BASE, "checkpoint.every=0", "checkpoint.resume={root}/group/checkpoints/step-0000004"),
        (S,),
    ),
    Run(
        "imported",
        "2-resume",
        (*BASE, "train.steps=4", "checkpoint.enabled=false", "model.init_from={root}/weights.pt"),
        (C,),
    ),
    Run(
        "round-trip",
        "2-resume",
        (*BASE, "train.steps=1", "checkpoint.enabled=false", "model.init_from={root}/exported"),
        (C,),
    ),
    Run("n4", "4", (*BASE, *PROFILED), (P, T)),
    Run("lora-n4", "4", (*BASE, *LORA), (L,)),
    # qlora's step-4 checkpoint continued at 4 ranks: the base rebuilt in 4 shards, the adapters resharded
    Run(
        "qlora-n4", "4", (*BASE, *QLORA, "checkpoint.every=0", f"checkpoint.resume={QLORA_4}"), (Q,)
    ),
    Run(
        "lora-reshard4",
        "4",
        (
            *BASE,
            *LORA,
            "checkpoint.every=0",
            "checkpoint.resume={root}/lora-split/checkpoints/step-0000004",
        ),
        (L,),
    ),
    Run(
        "hsdp",
        "4",
        (*BASE, *PROFILED, "parallel.strategy=hybrid_shard", "parallel.shard_size=2"),
        (P, T, K),
    ),
    # ZeRO++ hpZ (resharded over pairs after forward) with explicit prefetch of the next unit.
    Run(
        "hpz-prefetch",
        "4",
        (*BASE, *PROFILED, "parallel.reshard_after_forward=2", "parallel.prefetch=1"),
        (P, T),
    ),
    # HSDP's deferred reductions over micro-batches of 1 (2 a step): the single-process numbers.
    Run(
        "hsdp-replicas", "4", (*BASE, *HSDP_MB1, "parallel.grad_sync=replicas_once_per_step"), (T,)
    ),
    Run("hsdp-once", "4", (*BASE, *HSDP_MB1, "parallel.grad_sync=once_per_step"), (T,)),
    # ZeRO-1 and ZeRO-2 at 4 ranks for tests/test_comm.py's bytes (DDP's: full_shard-to-ddp-n4): two steps.
    Run(
        "zero1-n4",
        "4",
        (*BASE, "parallel.strategy=zero1", "train.steps=2", "checkpoint.enabled=false"),
        (T,),
    ),
    Run(
        "zero2-n4",
        "4",
        (*BASE, "parallel.strategy=shard_grad_op", "train.steps=2", "checkpoint.enabled=false"),
        (T,),
    ),
    Run("vit-n4", "4", (*VIT, *COMMON, "train.steps=1", "checkpoint.enabled=false"), (M,)),
    Run("reshard4", "4", (*BASE, "checkpoint.every=0", f"checkpoint.resume={SPLIT}"), (C,)),
    Run(
        "zero1-to-full_shard-n4",
        "4",
        (*BASE, "checkpoint.every=0", "checkpoint.resume={root}/zero1/checkpoints/step-0000004"),
        (C,),
    ),
    Run(
        "full_shard-to-ddp-n4",
        "4",
        (*BASE, "parallel.strategy=ddp", "checkpoint.every=0", f"checkpoint.resume={SPLIT}"),
        (C, T),
    ),
    # Tensor parallelism (dp 2 x tp 2, sequence-parallel; tp 4 without: the norm gains on FSDP's mesh
    # alone, the split layers on (dp, tp)), a dp 2 x tp 2 checkpoint continued at dp 4, and back.
    Run("tp2", "4", (*BASE, *PROFILED, TP2, "checkpoint.every=4"), (P, C, T)),
    # loss parallelism: the logits split over the vocabulary, validated as "eval" is; under ZeRO-2
    # with prefetch (tp4: with activation checkpointing; masked-tp2: reducing once a step)
    Run(
        "tp2-loss",
        "4",
        (
            *BASE,
            TP2,
            "parallel.loss_parallel=true",
            *EVAL,
            "parallel.strategy=shard_grad_op",
            "parallel.prefetch=1",
        ),
        (P,),
    ),
    # bf16-mixed under tensor parallelism: which dtype reaches TP's reductions (pytorch #190626)
    Run("tp2-bf16", "4", (*BASE, TP2, "precision=bf16-mixed", "train.steps=2"), (P,)),
    Run(
        "tp4",
        "4",
        (
            *BASE,
            "parallel.tp_size=4",
            "parallel.sequence_parallel=false",
            "parallel.activation_checkpointing=full",
        ),
        (P,),
    ),
    # masked data under tensor parallelism: the trained tokens counted over the data-parallel ranks
    Run(
        "masked-tp2",
        "4",
        (*BASE, *MASKED, TP2, "parallel.grad_sync=once_per_step"),
        ("test_masked",),
    ),
    # ... and under pipeline parallelism (pp 2 x dp 2: the stages of a dp rank read one batch)
    Run("masked-pp2", "4", (*BASE, *MASKED, PP2), ("test_masked",)),
    # a Hugging Face Llama, untied, split by its own plan (base_model_tp_plan and the head's)
    Run(
        "llama-tp2",
        "4",
        (*LLAMA, *UNTIED_EVEN, *COMMON, TP2, "checkpoint.enabled=false"),
        (M, T),
    ),
    # pp 2 x dp 2 (1F1B, 2 micro-batches a dp rank), validated as "eval" is
    Run("pp2-dp2", "4", (*BASE, PP2, "checkpoint.every=4", *EVAL), (P, C, T)),
    # pp 2 x tp 2 with loss parallelism: the last stage's logits split over the vocabulary, validated
    Run("pp2-tp2", "4", (*BASE, PP2, TP2, "parallel.loss_parallel=true", *EVAL), (P,)),
    # hybrid_shard under tensor parallelism: the mesh (dp_replicate 2, dp_shard 1, tp 2), the
    # replicas' all-reduce beside TP's collectives, the data-parallel group over both dimensions
    # (validated: its sums reduced over that group)
    Run(
        "hsdp-tp2",
        "4",
        (*BASE, "parallel.strategy=hybrid_shard", "parallel.shard_size=1", TP2, *EVAL),
        (P,),
    ),
    Run(
        "full_shard-to-pp2-dp2-n4",
        "4",
        (*BASE, PP2, "checkpoint.every=0", f"checkpoint.resume={SPLIT}"),
        (C,),
    ),
    Run(
        "full_shard-to-tp2-n4",
        "4",
        (*BASE, TP2, "checkpoint.every=0", f"checkpoint.resume={SPLIT}"),
        (C,),
    ),
    # n2's final weights (a torch.save state dict) into dp 2 x tp 2: each rank reads its box
    Run(
        "imported-tp2",
        "4-resume",
        (
            *BASE,
            TP2,
            "train.steps=4",
            "checkpoint.enabled=false",
            "model.init_from={root}/weights.pt",
        ),
        (C,),
    ),
    # ... into pp 2 x tp 2: each rank reads its stage's tensors, its box of each
    Run(
        "imported-pp2-tp2",
        "4-resume",
        (
            *BASE,
            TP2,
            PP2,
            "train.steps=4",
            "checkpoint.enabled=false",
            "model.init_from={root}/weights.pt",
        ),
        (C,),
    ),
    Run(
        "pp2-dp2-to-full_shard-n4",
        "4-resume",
        (
            *BASE,
            "checkpoint.every=0",
            "checkpoint.resume={root}/pp2-dp2/checkpoints/step-0000004",
        ),
        (C,),
    ),
    Run(
        "tp2-to-full_shard-n4",
        "4-resume",
        (
            *BASE,
            "checkpoint.every=0",
            "checkpoint.resume={root}/tp2/checkpoints/step-0000004",
        ),
        (C,),
    ),
    Run("n1", "1", BASE, (P, T)),
    # The same at N = 1 with micro-batches of 2 (4 accumulated) and of 8 (one).
    Run("masked-n1", "1", (*BASE, *MASKED), ("test_masked",)),
    Run("masked-n1-mb8", "1", (*BASE, *MASKED, "train.micro_batch_size=8"), ("test_masked",)),
    Run("lora-n1", "1", (*BASE, *LORA), (L,)),
    # float8 at one rank: tensorwise and its bf16 twin (4 steps)
    Run(
        "fp8-tw-n1",
        "1",
        (*BASE, *BF16, *FF_UNITS, "precision.float8=tensorwise", "train.steps=4"),
        (F,),
    ),
    Run("fp8-bf16-ff-n1", "1", (*BASE, *BF16, *FF_UNITS, "train.steps=4"), (F,)),
    # one rank: forwards of 4 and 1 windows
    Run("eval-n1", "1", (*BASE, "train.micro_batch_size=4", *EVAL), (E,)),
    Run("reshard1", "1", (*BASE, "checkpoint.every=0", f"checkpoint.resume={SPLIT}"), (C,)),
    Run(
        "ddp-to-full_shard-n1",
        "1",
        (*BASE, "checkpoint.every=0", "checkpoint.resume={root}/ddp/checkpoints/step-0000004"),
        (C,),
    ),
    # DeepSpeed's checkpoints continued (imported by the launch's prepare)
    *(
        Run(
            name,
            "2-resume" if ranks == 2 else "4-resume",
            (
                *ds_settings(case, ranks),
                "train.log_every=1",
                "checkpoint.every=0",
                "metrics.tensorboard=false",
                "memory.profile_step=0",
            ),
            ("test_ds_import",),
        )
        for name, (case, ranks) in DS_CONTINUED.items()
    ),
    # gloo's reduction at 3 ranks: uneven shards (64 rows over 3) and padding; 2 micro-batches of 2 a rank.
    Run("n3", "3", (*BASE, "train.global_batch_size=12"), (P, T)),
]
BY_NAME = {run.name: run for run in RUNS}
assert len(BY_NAME) == len(RUNS)


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
                [a.format(root=self.root) for a in r.args]
                + [f"run.root={self.root}", f"run.name={r.run_name or r.name}"],
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
