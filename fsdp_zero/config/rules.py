"""`validate`: every section's own check, then the few rules that span sections (a task and its data,
precision and the strategy, evaluation and the task), before anything is built or written."""

from __future__ import annotations

import importlib.util

from fsdp_zero.config.choices import (
    PP_SCHEDULES,
    ActivationCheckpointing,
    DataSource,
    Quantize,
    Task,
)
from fsdp_zero.config.presets import BUILTIN_FIELDS, model_args
from fsdp_zero.config.schema import TOKEN_SOURCES, Config
from fsdp_zero.config.strategies import STRATEGIES, is_fsdp, strategies_that

# The data sources each task reads.
_TASK_SOURCES = {
    Task.causal_lm: TOKEN_SOURCES,
    Task.classification: (DataSource.images, DataSource.fake_images),
}


def validate(cfg: Config) -> None:
    """Every section's ``check()``, and the rules that span sections. The built-in model's rules are
    `fsdp_zero.config.presets.check_model_config`'s (`fsdp_zero.config.loader.load_config` runs
    both); those that need the world size run when a run is set up (`Topology.of`,
    `BatchLayout.of`).

    Raises:
        ValueError: naming the key, the bad value and the valid choices.
    """
    cfg.model.check()
    # before data.check(): with the wrong source, its path is moot
    sources = _TASK_SOURCES.get(cfg.model.task)
    if sources and cfg.data.source not in sources:
        raise ValueError(
            f"data.source={cfg.data.source.value} does not feed model.task={cfg.model.task.value}; "
            f"valid choices: {', '.join(s.value for s in sources)}"
        )
    for section in (
        cfg.data,
        cfg.train,
        cfg.dist,
        cfg.optim,
        cfg.parallel,
        cfg.precision,
        cfg.memory,
        cfg.checkpoint,
        cfg.run,
        cfg.metrics,
        cfg.eval,
    ):
        section.check()
    cfg.eval.check_task(cfg.model.task)
    for key in ("stop_after", "max_minutes"):
        if getattr(cfg.train, key) is not None and not cfg.checkpoint.enabled:
            raise ValueError(
                f"train.{key} needs checkpoint.enabled=true: a run stopped early continues from "
                "its checkpoint"
            )
    _check_precision(cfg)
    check_qlora(cfg)
    _check_state_bits(cfg)
    _check_float8(cfg)
    _check_torchao(cfg)
    _check_tensor_parallel(cfg)
    _check_pipeline(cfg)


def _check_precision(cfg: Config) -> None:
    """LoRA's adapters never bf16; a gathered precision lower than the stored one needs FSDP."""
    p, strategy = cfg.precision, cfg.parallel.strategy
    if cfg.model.lora.rank and p.mode == "bf16-true":
        raise ValueError(
            f"model.lora.rank={cfg.model.lora.rank} with precision.mode=bf16-true is not supported "
            "(the adapters and their AdamW states would be bf16); LoRA runs with "
            "precision.mode=fp32, bf16-mixed or fp16-mixed"
        )
    mixed = (
        p.mode.endswith("-mixed")
        or p.param_dtype not in (None, "fp32")
        or p.reduce_dtype not in (None, "fp32")
    )
    if mixed and p.mode != "bf16-true" and not is_fsdp(strategy):
        raise ValueError(
            f"precision.mode={p.mode} (gathered parameters in a lower precision than the stored "
            f"ones) needs an FSDP strategy ({strategies_that('fsdp')}), not "
            f"parallel.strategy={strategy.value}; with {strategy.value} use precision.mode=fp32 or "
            "bf16-true"
        )


def check_qlora(cfg: Config) -> None:
    """model.lora.quantize=nf4: a pretrained base (the weights it quantizes, and rebuilds from on
    resume and export), an FSDP strategy (the NF4 shards are FSDP2's), a precision NF4 dequantizes to.
    The rules that need the model and the world size (whole NF4 blocks per shard, two shards at
    least) are `fsdp_zero.sharding.quantize.check_nf4`'s."""
    lora, m = cfg.model.lora, cfg.model
    if lora.quantize is Quantize.none:
        return
    setting = f"model.lora.quantize={lora.quantize.value}"
    if m.pretrained is None and m.init_from is None:
        raise ValueError(
            f"{setting} quantizes a pretrained base, and none is given: set model.pretrained (a "
            "Hugging Face folder) or model.init_from (a state dict file)"
        )
    if cfg.precision.mode not in _NF4_MODES:
        raise ValueError(
            f"{setting} with precision.mode={cfg.precision.mode}: valid choices: "
            f"{', '.join(_NF4_MODES)}"
        )
    strategy = cfg.parallel.strategy
    if not is_fsdp(strategy):
        raise ValueError(
            f"{setting} needs an FSDP strategy ({strategies_that('fsdp')}), not "
            f"parallel.strategy={strategy.value}: FSDP2 shards and gathers the NF4 base"
        )


def _check_torchao(cfg: Config) -> None:
    """The keys that need torchao (the ``lowbit`` extra) find it installed."""
    needs = {
        "model.lora.quantize": cfg.model.lora.quantize.value,
        "optim.state_bits": cfg.optim.state_bits,
        "precision.float8": cfg.precision.float8,
    }
    used = {k: v for k, v in needs.items() if v not in ("none", 32)}
    if used and importlib.util.find_spec("torchao") is None:
        key, value = next(iter(used.items()))
        raise ValueError(
            f"{key}={value} needs torchao, which is not installed: pip install 'fsdp-zero[lowbit]'"
        )


def _check_float8(cfg: Config) -> None:
    """precision.float8: bf16 compute around it, an FSDP strategy, and not what it cannot take yet
    (LoRA: torchao's conversion would replace a LoRALinear by a Float8Linear and drop its adapters);
    MXFP8's micro-batch a whole number of its 32-value blocks.
    Compile with emulation is refused when the device is known (`fsdp_zero.sharding.build`)."""
    recipe, par = cfg.precision.float8, cfg.parallel
    if recipe == "none":
        return
    setting = f"precision.float8={recipe}"
    if cfg.precision.mode not in ("bf16-mixed", "bf16-true"):
        raise ValueError(
            f"{setting} with precision.mode={cfg.precision.mode}: valid choices: bf16-mixed, "
            "bf16-true (float8 replaces bf16 matmuls)"
        )
    if not is_fsdp(par.strategy):
        raise ValueError(
            f"{setting} needs an FSDP strategy ({strategies_that('fsdp')}), not "
            f"parallel.strategy={par.strategy.value}"
        )
    if cfg.model.lora.rank:
        raise ValueError(
            f"{setting} with model.lora.rank={cfg.model.lora.rank} is not supported yet: torchao "
            "would replace LoRA's Linear and drop its adapters"
        )
    tokens = cfg.train.micro_batch_size * (
        cfg.data.seq_len if cfg.data.source in TOKEN_SOURCES else 1
    )
    if recipe == "mxfp8" and tokens % 32:
        raise ValueError(
            f"{setting}: a micro-batch of {tokens} tokens (train.micro_batch_size x data.seq_len) "
            "is not a multiple of MXFP8's blocks of 32; change either"
        )


def _check_state_bits(cfg: Config) -> None:
    """optim.state_bits < 32 (torchao's low-bit AdamW): what it does not combine with."""
    bits, o, par = cfg.optim.state_bits, cfg.optim, cfg.parallel
    if bits == 32:
        return
    setting = f"optim.state_bits={bits}"
    refused = (
        (
            "optim.step_group_size",
            o.step_group_size,
            "torchao's AdamW steps one tensor at a time already",
        ),
        (
            "parallel.strategy",
            "zero1" if STRATEGIES[par.strategy].zero_redundancy_optimizer else "",
            "ZeroRedundancyOptimizer takes torch's optimizers; use shard_grad_op or full_shard",
        ),
        (
            "parallel.cpu_offload",
            par.cpu_offload,
            "torchao's compiled step mixes the devices (pytorch/ao #1931)",
        ),
    )
    for key, value, why in refused:
        if value:
            shown = str(value).lower() if isinstance(value, bool) else value
            raise ValueError(f"{setting} with {key}={shown} is not supported: {why}")


# The precision modes QLoRA runs in: the NF4 base dequantizes to the stored dtype (fp32) and FSDP2
# gathers it for the compute dtype (bf16-mixed); bf16-true is LoRA's refusal, fp16-mixed untested.
_NF4_MODES = ("fp32", "bf16-mixed")


def _check_untested(cfg: Config, setting: str) -> None:
    """What tensor and pipeline parallelism do not take yet: adapters, frozen weights, offload,
    compile (measured to train differently from one process at dp 2 x tp 2, torch 2.15), and the
    low-bit levers (torchao's states and float8, untested there)."""
    m = cfg.model
    untested = (
        ("model.lora.rank", m.lora.rank),
        ("model.freeze", m.freeze),
        ("parallel.cpu_offload", cfg.parallel.cpu_offload),
        ("train.compile", cfg.train.compile),
        ("optim.state_bits", cfg.optim.state_bits != 32 and cfg.optim.state_bits),
        ("precision.float8", cfg.precision.float8 != "none" and cfg.precision.float8),
    )
    for key, value in untested:
        if value:
            shown = str(value).lower() if isinstance(value, bool) else value
            raise ValueError(f"{key}={shown} with {setting} is not supported yet")


def _check_pipeline(cfg: Config) -> None:
    """parallel.pp_size > 1: the causal_lm task on the built-in model (or a model.target that
    declares a pipeline plan, checked when it is built), untied, with at least one layer a stage;
    what it does not take yet refused."""
    pp, par, m = cfg.parallel.pp_size, cfg.parallel, cfg.model
    if pp == 1:
        return
    setting = f"parallel.pp_size={pp}"
    _check_untested(cfg, setting)
    if cfg.precision.mode == "fp16-mixed":
        raise ValueError(
            f"precision.mode=fp16-mixed with {setting} is not supported yet (its loss scaling); "
            "use bf16-mixed"
        )
    if PP_SCHEDULES[par.pp_schedule].zero_bubble:
        # each stage one FSDP unit (sharding/pipeline.py's stage_wrap): no blocks to recompute
        if par.activation_checkpointing is not ActivationCheckpointing.none:
            raise ValueError(
                f"parallel.activation_checkpointing={par.activation_checkpointing.value} with "
                f"parallel.pp_schedule={par.pp_schedule} is not supported yet; use 1F1B or "
                "Interleaved1F1B"
            )
        if cfg.eval.every:
            raise ValueError(
                f"eval.every={cfg.eval.every} with parallel.pp_schedule={par.pp_schedule}: torch "
                "2.15's zero-bubble schedules have no forward-only pass; use 1F1B or "
                "Interleaved1F1B, or eval.every=0"
            )
    if m.task is not Task.causal_lm:
        raise ValueError(
            f"model.task={m.task.value} with {setting} is not supported; valid choices: causal_lm"
        )
    if m.pretrained is not None:
        raise ValueError(
            f"model.pretrained with {setting} is not supported: a Hugging Face model passes "
            "keyword tensors (attention masks, rotary embeddings) between its layers, which a "
            "stage boundary does not carry; use parallel.tp_size"
        )
    if m.target is not None:
        return  # its pp_plan, checked against it when it is built (sharding/pipeline.py)
    args = model_args(m.preset, **{name: getattr(m, name) for name in BUILTIN_FIELDS})
    if args.tie_embeddings:
        raise ValueError(
            f"model.tie_embeddings=true with {setting} is not supported (the embedding lives on "
            "the first stage, the head on the last); set model.tie_embeddings=false"
        )
    stages = pp * par.stages_per_rank
    if args.n_layers < stages:
        raise ValueError(
            f"model.n_layers={args.n_layers} cannot fill {stages} pipeline stages "
            f"(parallel.pp_size={pp} x parallel.pp_stages_per_rank={par.stages_per_rank}); "
            "each stage holds at least one layer"
        )


def _check_tensor_parallel(cfg: Config) -> None:
    """parallel.tp_size > 1: what it supports (fully trained models, on the device), and for the
    built-in model every dimension it splits divisible by it (untied): heads and KV heads
    (attention's colwise wq/wk/wv), the feed-forward's hidden size, the vocabulary (the embedding's
    rows and the output's columns) and, with sequence parallelism, the sequence. Any other model's
    plan is checked against the model when it is built."""
    tp, m = cfg.parallel.tp_size, cfg.model
    if tp == 1:
        return
    setting = f"parallel.tp_size={tp}"
    _check_untested(cfg, setting)
    if cfg.parallel.loss_parallel and m.task is not Task.causal_lm:
        raise ValueError(
            f"parallel.loss_parallel=true needs model.task=causal_lm (its cross-entropy runs on "
            f"the vocabulary's shards), not {m.task.value}"
        )
    if m.target is not None or m.pretrained is not None:
        return  # a model's own plan, checked against it when it is built (sharding/tensor.py)
    args = model_args(m.preset, **{name: getattr(m, name) for name in BUILTIN_FIELDS})
    if args.tie_embeddings:
        raise ValueError(
            f"model.tie_embeddings=true with {setting} is not supported (the embedding and the "
            "output would split one weight two ways); set model.tie_embeddings=false"
        )
    split = {
        "model.n_heads": args.n_heads,
        "model.n_kv_heads": args.kv_heads,
        "model.ffn_hidden_dim": args.hidden_dim,
        "model.vocab_size": args.vocab_size,
    }
    if cfg.parallel.sequence_parallel:
        split["data.seq_len"] = cfg.data.seq_len
    for key, value in split.items():
        if value % tp:
            raise ValueError(
                f"{key}={value} must be a multiple of {setting} (each rank takes 1/{tp} of it)"
                + ("; or set parallel.sequence_parallel=false" if key == "data.seq_len" else "")
            )
