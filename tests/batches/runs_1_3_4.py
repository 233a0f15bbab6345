"""The runs at 4, 1 and 3 ranks, launches "4", "4-resume", "1" and "3": each run's name, launch,
overrides, and the test modules that read it (settings.py's P for tests/test_parity.py, ...)."""

from __future__ import annotations

from tests.batches.settings import (
    BASE,
    BF16,
    COMMON,
    DISK,
    EVAL,
    FF_UNITS,
    GROUPED,
    HSDP_MB1,
    LLAMA,
    LORA,
    MASKED,
    PP2,
    PROFILED,
    QLORA,
    QLORA_4,
    SP2,
    SP4,
    SPLIT,
    TP2,
    UNTIED_EVEN,
    VIT,
    C,
    E,
    F,
    K,
    L,
    M,
    O,
    P,
    Q,
    Run,
    T,
    ds_continued_runs,
)

RUNS_1_3_4 = [
    Run("n4", "4", (*BASE, *PROFILED), (P, T, "test_sequence")),
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
    Run("reshard4", "4", (*BASE, "checkpoint.every=0", f"checkpoint.resume={SPLIT}"), (C, O)),
    # the files' run's step-4 checkpoint continued at 4 ranks with its moments in files again
    Run(
        "offload-reshard4",
        "4",
        (
            *BASE,
            *GROUPED,
            *DISK,
            "checkpoint.every=0",
            "checkpoint.resume={root}/offload-disk/checkpoints/step-0000004",
        ),
        (O,),
    ),
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
    # Ulysses at 4: sp 4 (every block checkpointed: its all-to-alls run again in backward); sp 2 x
    # hybrid_shard (2 replicas of a 2-rank shard group that is one sequence-parallel group); masked
    # data at dp 2 x sp 2 (the trained tokens counted over all four); n2's checkpoint continued at
    # sp 4, and sp2's (launch "2") without sequence parallelism
    Run(
        "sp4",
        "4",
        (*BASE, SP4, "parallel.activation_checkpointing=full"),
        (P, "test_sequence", "test_comm"),
    ),
    Run(
        "hsdp-sp2",
        "4",
        (*BASE, "parallel.strategy=hybrid_shard", "parallel.shard_size=2", SP2, *EVAL),
        (P,),
    ),
    Run("masked-sp2", "4", (*BASE, *MASKED, SP2), ("test_masked",)),
    Run(
        "full_shard-to-sp4-n4",
        "4",
        (*BASE, SP4, "checkpoint.every=0", f"checkpoint.resume={SPLIT}"),
        (C,),
    ),
    Run(
        "sp2-to-full_shard-n4",
        "4",
        (*BASE, "checkpoint.every=0", "checkpoint.resume={root}/sp2/checkpoints/step-0000004"),
        (C,),
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
    *ds_continued_runs(4, "4-resume"),
    # gloo's reduction at 3 ranks: uneven shards (64 rows over 3) and padding; 2 micro-batches of 2 a rank.
    Run("n3", "3", (*BASE, "train.global_batch_size=12"), (P, T)),
]
