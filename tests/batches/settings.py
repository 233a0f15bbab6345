"""The suite's batched runs' settings: the overrides each run is made of, what a run and a launch are.

tests/batches/runs_2.py and runs_1_3_4.py declare the runs from these; test modules import the
settings they compare with (BASE, LORA, ...) through `tests.batches`.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tests.conftest import REPO

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
# Ulysses sequence parallelism (tests/test_sequence.py): each sequence cut over 2 (4) ranks
SP2, SP4 = "parallel.sp_size=2", "parallel.sp_size=4"
# the built-in mixture of experts (tests/test_experts.py): 8 experts, top 2; expert parallelism
MOE = ("model.preset=moe_nano",)
EP2, EP4 = "parallel.ep_size=2", "parallel.ep_size=4"
# its top-1 twin whose router starts at zero: every token routed to expert 0 on the first step
ONE_EXPERT = ("model.experts_top_k=1", "model.init_from={root}/bases/moe-one-expert.pt")
# a tiny Hugging Face Qwen3-MoE (4 experts, top 2, every layer a mixture) saved by transformers in
# the Hub's format, its experts one Linear each (tests/batches/launches.py makes it)
QWEN3_MOE = ("model.pretrained={root}/qwen3-moe", "data.seq_len=16")
QWEN3_MOE_CONFIG = dict(
    vocab_size=101,
    hidden_size=32,
    intermediate_size=64,
    moe_intermediate_size=32,
    num_experts=4,
    num_experts_per_tok=2,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
    router_aux_loss_coef=0.01,
)
X = "test_experts"
# pipeline parallelism: two stages (gpt_nano's two layers, one each; four under the V schedule)
PP2 = "parallel.pp_size=2"
FOUR_LAYERS = ("model.n_layers=4",)
HSDP_MB1 = ("parallel.strategy=hybrid_shard", "parallel.shard_size=2", "train.micro_batch_size=1")


# A run that sets no checkpoint key saves its final checkpoint only where a test reads it (these);
# the others train with checkpoint.enabled=false (`Batches`: a save is a few tenths of a second of a
# 2-core machine, some 40 runs).
FINAL_READ = frozenset(
    {
        "bf16-mixed",  # tests/test_step_group.py's and test_offload.py's final AdamW states
        "group-bf16",
        "offload-half",
        "offload-disk-bf16",
        "offload-cpu-half-bf16",
        "overflow",  # tests/test_parity.py: the scaler's state in train_state.json
    }
)


@dataclass(frozen=True)
class Run:
    name: str
    launch: str
    args: tuple[str, ...]
    readers: tuple[str, ...]  # the test modules that read it
    run_name: str = ""  # the run directory under the launch root (default: name)
    options: dict = field(default_factory=dict)  # tests/workers/jobs.py's per-job options

    def job_args(self, root: Path) -> list[str]:
        """Its overrides as the launch passes them: ``{root}`` filled in, its run directory, and no
        checkpoints where it asks for none and no test reads its last (`FINAL_READ`)."""
        args = [a.format(root=root) for a in self.args]
        if not any(a.startswith("checkpoint.") for a in self.args) and self.name not in FINAL_READ:
            args.append("checkpoint.enabled=false")
        return args + [f"run.root={root}", f"run.name={self.run_name or self.name}"]


@dataclass(frozen=True)
class Launch:
    nproc: int  # 0: plain python (world size 1)
    after: tuple[str, ...] = ()  # launches whose checkpoints its runs read
    # files its runs read, made first in the test process
    prepare: Callable[[Path], None] | None = None


# A run's readers (Run.readers: the test modules, by file stem, that read it), in one letter.
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
# tests/test_offload.py's: AdamW's moments in files under the launch's folder (each rank a folder of
# its own), in host memory, or the last half of the step groups only; GROUPED's groups are the swap units
O = "test_offload"
DISK = ("offload.states=disk", "offload.path={root}")
HOST = ("offload.states=cpu",)
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
# tests/test_lowbit_adamw.py's: only the feed-forward's w1 and w3 (96 x 64 shards at 2 ranks: 6,144 values,
# packed) and the attention's wq (2,048: fp32 states) train
LOW_BIT = (
    r"model.freeze=[tok_embeddings.weight,output.weight,.*norm.*,.*\.(wk|wv|wo|w2)\.weight]",
)
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


def ds_continued_runs(ranks: int, launch: str) -> list[Run]:
    """DeepSpeed's checkpoints continued at ``ranks`` ranks in ``launch`` (imported by the launch's
    prepare)."""
    return [
        Run(
            name,
            launch,
            (
                *ds_settings(case, n),
                "train.log_every=1",
                "checkpoint.every=0",
                "metrics.tensorboard=false",
                "memory.profile_step=0",
            ),
            ("test_ds_import",),
        )
        for name, (case, n) in DS_CONTINUED.items()
        if n == ranks
    ]
