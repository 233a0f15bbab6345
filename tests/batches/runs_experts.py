"""The mixture-of-experts runs (tests/test_experts.py), at 2, 4 and 1 ranks: the built-in moe_nano
under expert parallelism (ep 2 at 2 ranks, ep 2 x dp 2, ep 4 with every block recomputed, ep 2
under hybrid_shard), its every-token-to-one-expert twin, LoRA with the experts frozen, a Hugging
Face Qwen3-MoE at ep 2, and ep 2's checkpoint continued at ep 4 and at one rank."""

from __future__ import annotations

from tests.batches.settings import (
    BASE,
    COMMON,
    EP2,
    EP4,
    MOE,
    ONE_EXPERT,
    QWEN3_MOE,
    Run,
    X,
)

EP2_4 = "{root}/ep2/checkpoints/step-0000004"

RUNS_EXPERTS = [
    Run("ep2", "2", (*BASE, *MOE, EP2, "checkpoint.every=4"), (X,)),
    Run("ep2-one-expert", "2", (*BASE, *MOE, EP2, *ONE_EXPERT, "train.steps=4"), (X,)),
    Run(
        "ep2-lora",
        "2",
        (*BASE, *MOE, EP2, "model.lora.rank=4", "model.lora.targets=[wq,wv]", "train.steps=4"),
        (X,),
    ),
    Run("qwen3-moe-ep2", "2", (*QWEN3_MOE, *COMMON, EP2), (X,)),
    Run("ep2-dp2", "4", (*BASE, *MOE, EP2), (X,)),
    Run("ep4", "4", (*BASE, *MOE, EP4, "parallel.activation_checkpointing=full"), (X,)),
    Run(
        "hsdp-ep2",
        "4",
        (*BASE, *MOE, EP2, "parallel.strategy=hybrid_shard", "parallel.shard_size=2"),
        (X,),
    ),
    Run(
        "ep2-to-ep4-n4",
        "4",
        (*BASE, *MOE, EP4, "checkpoint.every=0", f"checkpoint.resume={EP2_4}"),
        (X,),
    ),
    Run(
        "ep2-to-ep1-n1",
        "1",
        (*BASE, *MOE, "checkpoint.every=0", f"checkpoint.resume={EP2_4}"),
        (X,),
    ),
]
