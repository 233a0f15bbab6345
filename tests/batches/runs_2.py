"""The runs at 2 ranks, launches "2" and "2-resume": each run's name, launch, overrides, and the test
modules that read it (settings.py's P for tests/test_parity.py, C for tests/test_checkpoint.py, ...)."""

from __future__ import annotations

from tests.batches.settings import (
    ADAMW8_4,
    BASE,
    BF16,
    COMMON,
    DISK,
    EVAL,
    FF_UNITS,
    FOUR_LAYERS,
    FP8_4,
    FREEZE,
    GROUPED,
    HOST,
    LLAMA,
    LORA,
    LOW_BIT,
    MASKED,
    PP2,
    PROFILED,
    QLORA,
    QLORA_4,
    SP2,
    SPLIT,
    TIED,
    VIT,
    B,
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
    S,
    T,
    ds_continued_runs,
)

RUNS_2 = [
    # ZeRO-3 straight through, saving every 2 steps (retention keeps 6 and 8): the parity run and the
    # checkpoint tests' straight run.
    Run(
        "n2",
        "2",
        (*BASE, *PROFILED, "checkpoint.every=2", "checkpoint.keep_last=2"),
        (P, C, "test_cli", E, T, S, K, O),
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
    # Ulysses: both ranks hold half of every sequence (dp 1 x sp 2), validated as "eval" is; its
    # step-4 checkpoint continues without sequence parallelism at 4 ranks
    Run(
        "sp2", "2", (*BASE, SP2, "checkpoint.every=4", *EVAL), (P, C, "test_sequence", "test_comm")
    ),
    # FSDP1's name for it
    Run("zero2", "2", (*BASE, *PROFILED, "parallel.strategy=SHARD_GRAD_OP", *EVAL), (P, T, E)),
    # The memory levers: plain ZeRO-3's numbers bit for bit; CPU offload and full checkpointing share a run.
    Run(
        "ac-full",
        "2",
        (*BASE, *PROFILED, "parallel.activation_checkpointing=full", "parallel.cpu_offload=true"),
        (P, "test_act_offload"),
    ),
    # ac-full with its checkpointed blocks' inputs moved to the host: ac-full's numbers bit for bit
    # (tests/test_act_offload.py), TensorBoard on for memory/offloaded_activations_mib
    Run(
        "ac-offload",
        "2",
        (
            *BASE,
            *PROFILED,
            "parallel.activation_checkpointing=full",
            "parallel.cpu_offload=true",
            "parallel.activation_offload=true",
            "metrics.tensorboard=true",
        ),
        ("test_act_offload",),
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
        "split", "2", (*BASE, "train.stop_after=4", "checkpoint.every=0"), (C, S, T, O)
    ),  # T: full_shard-to-ddp-n4 reads it
    Run(
        "async",
        "2",
        (*BASE, "checkpoint.async_save=true", "checkpoint.every=2", "checkpoint.keep_last=2"),
        (C,),
        options={"slow_writes": 0.3},
    ),
    Run("vit", "2", (*VIT, *COMMON), (M,)),
    # tests/test_trace.py's: steps 2 and 3 traced (one trace a rank), left out of the throughput
    Run("trace", "2", (*BASE, "train.steps=4", "metrics.trace_steps=[2,3]"), ("test_trace",)),
    Run("llama", "2", (*LLAMA, *COMMON), (M,)),
    # ... under sequence parallelism: attention through transformers' interface, fsdp-zero's function
    Run("llama-sp2", "2", (*LLAMA, *COMMON, SP2, "checkpoint.enabled=false"), (M, "test_sequence")),
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
    Run("masked", "2", (*BASE, *MASKED), ("test_masked", "test_tiled_loss")),
    # The tiled loss (tests/test_tiled_loss.py): ``masked`` with chunks of 7 of a micro-batch's 64 tokens.
    Run("masked-tiled", "2", (*BASE, *MASKED, "train.loss_chunk=7"), ("test_tiled_loss",)),
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
    Run("group", "2", (*BASE, *GROUPED, "checkpoint.every=4"), (S, O)),
    Run("group-bf16", "2", (*BASE, *GROUPED, "precision=bf16-mixed"), (S, O)),
    Run("group-zero1", "2", (*BASE, *GROUPED, "parallel.zero_stage=1", "checkpoint.every=4"), (S,)),
    # ... with AdamW's moments offloaded (offload.states): in files, in host memory, half of the
    # groups, under bf16-mixed: the grouped runs' bits
    Run("offload-disk", "2", (*BASE, *GROUPED, *DISK, "checkpoint.every=4"), (O,)),
    Run("offload-cpu", "2", (*BASE, *GROUPED, *HOST, "checkpoint.every=4"), (O,)),
    Run(
        "offload-half",
        "2",
        (*BASE, *GROUPED, *DISK, "offload.ratio=0.5", "metrics.tensorboard=true"),
        (O,),
    ),
    Run("offload-disk-bf16", "2", (*BASE, *GROUPED, *DISK, *BF16), (O,)),
    Run("offload-cpu-half-bf16", "2", (*BASE, *GROUPED, *HOST, "offload.ratio=0.5", *BF16), (O,)),
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
    # The in-memory step-4 checkpoint continued with the moments in files, and the files' run's
    # continued in memory: the straight run's bits.
    Run(
        "offload-resumed",
        "2-resume",
        (*BASE, *GROUPED, *DISK, "checkpoint.every=0", f"checkpoint.resume={SPLIT}"),
        (O,),
    ),
    Run(
        "offload-to-memory",
        "2-resume",
        (
            *BASE,
            "checkpoint.every=0",
            "checkpoint.resume={root}/offload-disk/checkpoints/step-0000004",
        ),
        (O,),
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
    *ds_continued_runs(2, "2-resume"),
]
