"""`validate`: every section's own check, then the rules that span sections, before anything is built
or written.

Most of those are refusals: one setting, while it is on, does not combine with another. They are
rows of one table, `REFUSALS` (docs/memory-levers.md renders it as a matrix), and one check raises
each row's error in one form: ``{when}={value} with {refuses}={value} is not supported: {why}``.
The few rules where a value must fit another value (a task's data, the sizes tensor and pipeline
parallelism split, MXFP8's blocks) are functions below the table, each returning its error.
"""

from __future__ import annotations

import enum
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

from fsdp_zero.config.choices import (
    PP_SCHEDULES,
    ActivationCheckpointing,
    DataSource,
    Float8Recipe,
    PrecisionMode,
    Quantize,
    StateTier,
    Task,
    WrapPolicy,
)
from fsdp_zero.config.presets import BUILTIN_FIELDS, TransformerArgs, model_args
from fsdp_zero.config.schema import (
    TOKEN_SOURCES,
    Config,
    DataConfig,
    ModelConfig,
    ParallelConfig,
    PrecisionConfig,
    TrainConfig,
)
from fsdp_zero.config.strategies import GRAD_SYNC_NEEDS, STRATEGIES, is_fsdp, strategies_that


@dataclass(frozen=True)
class Refusal:
    """While ``when`` is ``active``, ``refuses`` may not be ``bad``: a run with both is refused at
    start-up with one line naming both keys and their values, and ``why``.

    ``yet``: not built or not tested yet, rather than impossible. ``example``: overrides that trip
    this row alone (the table's test loads each; ``{tmp}`` is a folder holding a Hugging Face
    ``config.json`` and a token file ``val.bin``).
    """

    when: str
    active: Callable[[Config], bool]
    refuses: str
    bad: Callable[[Config], bool]
    why: str
    yet: bool = False
    example: tuple[str, ...] = ()


_FSDP = f"it needs an FSDP strategy ({strategies_that('fsdp')})"
_TP, _PP, _SP = "parallel.tp_size", "parallel.pp_size", "parallel.sp_size"
_EP = "parallel.ep_size"
_STRATEGY = "parallel.strategy"
_QLORA = ("model.lora.rank=4", "model.lora.targets=[wq]", "model.lora.quantize=nf4")
_BF16 = "precision=bf16-mixed"
# each stage one FSDP unit (sharding/pipeline.py's stage_wrap): no blocks to recompute; and no
# forward-only pass in torch 2.15
_ZERO_BUBBLE = "parallel.pp_schedule=ZBVZeroBubble"


def _while_split(key: str, rows: tuple) -> tuple[Refusal, ...]:
    """The refusals while a split axis's size ``key`` (``parallel.<axis>_size``) is above 1: each
    row (refused key, bad, why, yet, example), its example with ``key=2``."""
    size = key.partition(".")[2]
    return tuple(
        Refusal(
            key,
            lambda c: getattr(c.parallel, size) > 1,
            refused,
            bad,
            why,
            yet=yet,
            example=(*ex, f"{key}=2"),
        )
        for refused, bad, why, yet, ex in rows
    )


def _zero_bubble(p: ParallelConfig) -> bool:
    return p.pp_size > 1 and PP_SCHEDULES[p.pp_schedule].zero_bubble


def _lower_gathered(p: PrecisionConfig) -> bool:
    """Parameters gathered in a lower precision than the stored ones (FSDP's mixed precision)."""
    mixed = (
        p.mode.endswith("-mixed")
        or p.param_dtype not in (None, "fp32")
        or p.reduce_dtype not in (None, "fp32")
    )
    return mixed and p.mode != PrecisionMode.bf16_true


def _builtin_tied(m: ModelConfig) -> bool:
    return m.target is None and m.pretrained is None and bool(m.tie_embeddings)


def _grad_sync_rows() -> list[Refusal]:
    """A grad_sync mode that reduces fewer times needs the strategies that can hold off."""
    return [
        Refusal(
            "parallel.grad_sync",
            lambda c, mode=mode: c.parallel.grad_sync == mode,
            _STRATEGY,
            lambda c, needs=needs: not getattr(STRATEGIES[c.parallel.strategy], needs),
            f"it applies to parallel.strategy={strategies_that(needs)} only",
            example=(f"parallel.grad_sync={mode.value}", "parallel.strategy=ddp"),
        )
        for mode, needs in GRAD_SYNC_NEEDS.items()
    ]


def _untested_rows(key: str, active: Callable[[ParallelConfig], bool], name: str) -> list[Refusal]:
    """What tensor and pipeline parallelism (``key``, ``name``) do not take yet: adapters, frozen
    weights, offload, compile, and the low-bit levers (torchao's states and float8)."""
    untested = f"untested with {name}"
    levers = (
        ("model.lora.rank", lambda c: c.model.lora.rank > 0, ("model.lora.targets=[wq]",), ""),
        ("model.freeze", lambda c: bool(c.model.freeze), (), ""),
        ("parallel.cpu_offload", lambda c: c.parallel.cpu_offload, (), ""),
        ("offload.states", lambda c: c.offload.states is not StateTier.none, (), ""),
        # measured at dp 2 x tp 2 (torch 2.15)
        (
            "train.compile",
            lambda c: c.train.compile,
            (),
            "; it trains differently from one process",
        ),
        ("optim.state_bits", lambda c: c.optim.state_bits != 32, (), " (torchao)"),
        ("precision.float8", lambda c: c.precision.float8 != "none", (_BF16,), " (torchao)"),
    )
    value = {
        "model.lora.rank": "4",
        "model.freeze": "[x]",
        "parallel.cpu_offload": "true",
        "offload.states": "cpu",
        "train.compile": "true",
        "optim.state_bits": "8",
        "precision.float8": "rowwise",
    }
    return [
        Refusal(
            lever,
            on,
            key,
            lambda c: active(c.parallel),
            untested + note,
            yet=True,
            example=(f"{lever}={value[lever]}", *extra, f"{key}=2"),
        )
        for lever, on, extra, note in levers
    ]


REFUSALS: tuple[Refusal, ...] = (
    # precision
    Refusal(
        "model.lora.rank",
        lambda c: c.model.lora.rank > 0,
        "precision.mode",
        lambda c: c.precision.mode == PrecisionMode.bf16_true,
        "the adapters and their AdamW states would be bf16; LoRA runs with precision.mode=fp32, "
        "bf16-mixed or fp16-mixed",
        example=("model.lora.rank=4", "model.lora.targets=[wq]", "precision=bf16-true"),
    ),
    Refusal(
        "precision.mode",
        lambda c: _lower_gathered(c.precision),
        _STRATEGY,
        lambda c: not is_fsdp(c.parallel.strategy),
        f"parameters gathered in a lower precision than the stored ones: {_FSDP}; otherwise use "
        "precision.mode=fp32 or bf16-true",
        example=(_BF16, "parallel.strategy=zero1"),
    ),
    # what each strategy takes
    Refusal(
        "parallel.reshard_after_forward",
        lambda c: c.parallel.reshard_after_forward is not None,
        _STRATEGY,
        lambda c: not STRATEGIES[c.parallel.strategy].hpz,
        f"it applies to parallel.strategy={strategies_that('hpz')} only",
        example=("parallel.reshard_after_forward=2", "parallel.strategy=ddp"),
    ),
    Refusal(
        "parallel.cpu_offload",
        lambda c: c.parallel.cpu_offload,
        _STRATEGY,
        lambda c: not is_fsdp(c.parallel.strategy),
        _FSDP,
        example=("parallel.cpu_offload=true", "parallel.strategy=ddp"),
    ),
    *_grad_sync_rows(),
    *(
        Refusal(
            key,
            lambda c, key=key: getattr(c.parallel, key.split(".")[1]) > 1,
            _STRATEGY,
            lambda c: not STRATEGIES[c.parallel.strategy].takes_tp,
            f"it needs parallel.strategy={strategies_that('takes_tp')}",
            example=(f"{key}=2", "parallel.strategy=ddp"),
        )
        for key in (_TP, _PP)
    ),
    # QLoRA: the NF4 base dequantizes to the stored dtype (fp32) and FSDP2 gathers it for the
    # compute dtype (bf16-mixed); bf16-true is LoRA's refusal, fp16-mixed untested
    Refusal(
        "model.lora.quantize",
        lambda c: c.model.lora.quantize is not Quantize.none,
        "precision.mode",
        lambda c: c.precision.mode not in ("fp32", "bf16-mixed"),
        "valid choices: fp32, bf16-mixed (the NF4 base dequantizes to fp32, gathered in bf16)",
        example=(*_QLORA, "model.init_from=pyproject.toml", "precision=fp16-mixed"),
    ),
    Refusal(
        "model.lora.quantize",
        lambda c: c.model.lora.quantize is not Quantize.none,
        _STRATEGY,
        lambda c: not is_fsdp(c.parallel.strategy),
        f"{_FSDP}: FSDP2 shards and gathers the NF4 base",
        example=(*_QLORA, "model.init_from=pyproject.toml", "parallel.strategy=ddp"),
    ),
    # torchao's low-bit AdamW
    *(
        Refusal("optim.state_bits", lambda c: c.optim.state_bits != 32, key, bad, why, example=ex)
        for key, bad, why, ex in (
            (
                "optim.step_group_size",
                lambda c: c.optim.step_group_size > 0,
                "torchao's AdamW steps one tensor at a time already",
                ("optim.state_bits=8", "optim.step_group_size=5000"),
            ),
            (
                _STRATEGY,
                lambda c: STRATEGIES[c.parallel.strategy].zero_redundancy_optimizer,
                "ZeroRedundancyOptimizer takes torch's optimizers; use shard_grad_op or full_shard",
                ("optim.state_bits=4", "parallel.strategy=zero1"),
            ),
            (
                "parallel.cpu_offload",
                lambda c: c.parallel.cpu_offload,
                "torchao's compiled step mixes the devices (pytorch/ao #1931)",
                ("optim.state_bits=8", "parallel.cpu_offload=true"),
            ),
        )
    ),
    # float8: bf16 compute around it, an FSDP strategy, and not what it cannot take yet
    *(
        Refusal(
            "precision.float8",
            lambda c: c.precision.float8 != Float8Recipe.none,
            key,
            bad,
            why,
            yet=key == "model.lora.rank",
            example=("precision.float8=rowwise", *ex),
        )
        for key, bad, why, ex in (
            (
                "precision.mode",
                lambda c: c.precision.mode not in ("bf16-mixed", "bf16-true"),
                "valid choices: bf16-mixed, bf16-true (float8 replaces bf16 matmuls)",
                ("precision=fp32",),
            ),
            (
                _STRATEGY,
                lambda c: not is_fsdp(c.parallel.strategy),
                _FSDP,
                ("precision=bf16-true", "parallel.strategy=ddp"),
            ),
            (
                "model.lora.rank",
                lambda c: c.model.lora.rank > 0,
                "torchao would replace LoRA's Linear and drop its adapters",
                (_BF16, "model.lora.rank=4", "model.lora.targets=[wq]"),
            ),
        )
    ),
    # offload.states: AdamW's states in host memory or files, swapped in around each group's step
    *(
        Refusal(
            "offload.states",
            lambda c: c.offload.states is not StateTier.none,
            key,
            bad,
            why,
            yet=yet,
            example=("offload.states=cpu", *ex),
        )
        for key, bad, why, yet, ex in (
            (
                _STRATEGY,
                lambda c: not is_fsdp(c.parallel.strategy),
                _FSDP,
                False,
                ("parallel.strategy=zero1",),
            ),
            (
                "optim.state_bits",
                lambda c: c.optim.state_bits != 32,
                "torchao's low-bit AdamW keeps its states in tensors of its own",
                True,
                ("optim.state_bits=8",),
            ),
        )
    ),
    Refusal(
        "offload.states",
        lambda c: c.offload.states is StateTier.cpu,
        "parallel.cpu_offload",
        lambda c: c.parallel.cpu_offload,
        "FSDP2's offload keeps the states in host memory already (offload.states=disk moves them "
        "on to files)",
        example=("offload.states=cpu", "parallel.cpu_offload=true"),
    ),
    Refusal(
        "offload.states",
        lambda c: c.offload.states is StateTier.disk,
        "checkpoint.async_save",
        lambda c: c.checkpoint.async_save,
        "an asynchronous save stages every state in memory first",
        example=("offload.states=disk", "offload.path={tmp}", "checkpoint.async_save=true"),
    ),
    Refusal(
        "offload.ratio",
        lambda c: c.offload.ratio != 1,
        "offload.states",
        lambda c: c.offload.states is StateTier.none,
        "the ratio divides the step groups between the device and offload.states' tier; set "
        "offload.states=cpu or disk",
        example=("offload.ratio=0.5",),
    ),
    # sequence parallelism (fsdp_zero/sharding/sequence.py): the model sharded over its ranks
    *_while_split(
        _SP,
        (
            (
                _STRATEGY,
                lambda c: not is_fsdp(c.parallel.strategy),
                f"{_FSDP}: its ranks shard the model (ALST's layout)",
                False,
                ("parallel.strategy=ddp",),
            ),
            (
                "model.task",
                lambda c: c.model.task is not Task.causal_lm,
                "each rank holds a slice of every sequence: it needs model.task=causal_lm",
                False,
                ("model.task=custom", "model.loss=tests.user_model:overflow_on_rank1"),
            ),
            (
                _TP,
                lambda c: c.parallel.tp_size > 1,
                "not built with tensor parallelism",
                True,
                (f"{_TP}=2",),
            ),
            (
                _PP,
                lambda c: c.parallel.pp_size > 1,
                "not built with pipeline parallelism",
                True,
                (f"{_PP}=2",),
            ),
            (
                "parallel.reshard_after_forward",
                lambda c: c.parallel.reshard_after_forward is not None,
                "hpZ's groups are not laid out over the sequence-parallel ranks",
                True,
                ("parallel.reshard_after_forward=2",),
            ),
        ),
    ),
    # expert parallelism (fsdp_zero/sharding/experts.py): the experts sharded over its ranks
    *_while_split(
        _EP,
        (
            (
                _STRATEGY,
                lambda c: not is_fsdp(c.parallel.strategy),
                f"{_FSDP}: its ranks shard the experts (FSDP2 + EP)",
                False,
                ("model.preset=moe_nano", "parallel.strategy=ddp"),
            ),
            (
                "parallel.wrap.policy",
                lambda c: c.parallel.wrap.policy is WrapPolicy.none,
                "the experts are FSDP units of their own, on their own mesh",
                False,
                ("model.preset=moe_nano", "parallel.wrap.policy=none"),
            ),
            (
                _TP,
                lambda c: c.parallel.tp_size > 1,
                "not built with tensor parallelism",
                True,
                ("model.preset=moe_nano", f"{_TP}=2"),
            ),
            (
                _PP,
                lambda c: c.parallel.pp_size > 1,
                "not built with pipeline parallelism",
                True,
                ("model.preset=moe_nano", f"{_PP}=2"),
            ),
            (
                _SP,
                lambda c: c.parallel.sp_size > 1,
                "not built with sequence parallelism",
                True,
                ("model.preset=moe_nano", f"{_SP}=2"),
            ),
            (
                "parallel.reshard_after_forward",
                lambda c: c.parallel.reshard_after_forward is not None,
                "hpZ's groups are not laid out over the expert-parallel ranks",
                True,
                ("model.preset=moe_nano", "parallel.reshard_after_forward=2"),
            ),
        ),
    ),
    # tensor parallelism
    *_untested_rows(_TP, lambda p: p.tp_size > 1, "tensor parallelism"),
    Refusal(
        "parallel.loss_parallel",
        lambda c: c.parallel.loss_parallel and c.parallel.tp_size > 1,
        "model.task",
        lambda c: c.model.task is not Task.causal_lm,
        "its cross-entropy runs on the vocabulary's shards: it needs model.task=causal_lm",
        example=(
            "parallel.loss_parallel=true",
            "parallel.tp_size=2",
            "model.task=custom",
            "model.loss=tests.user_model:overflow_on_rank1",
        ),
    ),
    Refusal(
        "model.tie_embeddings",
        lambda c: _builtin_tied(c.model),
        _TP,
        lambda c: c.parallel.tp_size > 1,
        "the embedding and the output would split one weight two ways; set "
        "model.tie_embeddings=false",
        example=("model.tie_embeddings=true", f"{_TP}=2"),
    ),
    # activation offload moves what checkpointing keeps (fsdp_zero/sharding/act_offload.py)
    Refusal(
        "parallel.activation_offload",
        lambda c: c.parallel.activation_offload,
        "parallel.activation_checkpointing",
        lambda c: c.parallel.activation_checkpointing is ActivationCheckpointing.none,
        "it moves the inputs checkpointing keeps per block to the host, so it needs "
        "checkpointing; set parallel.activation_checkpointing=full or selective",
        example=("parallel.activation_offload=true",),
    ),
    # pipeline parallelism
    *_untested_rows(_PP, lambda p: p.pp_size > 1, "pipeline parallelism"),
    Refusal(
        "parallel.activation_offload",
        lambda c: c.parallel.activation_offload,
        _PP,
        lambda c: c.parallel.pp_size > 1,
        "untested with pipeline parallelism",
        yet=True,
        example=(
            "parallel.activation_offload=true",
            "parallel.activation_checkpointing=full",
            f"{_PP}=2",
        ),
    ),
    Refusal(
        "precision.mode",
        lambda c: c.precision.mode == PrecisionMode.fp16_mixed,
        _PP,
        lambda c: c.parallel.pp_size > 1,
        "its loss scaling; use bf16-mixed",
        yet=True,
        example=("precision=fp16-mixed", f"{_PP}=2"),
    ),
    Refusal(
        "parallel.activation_checkpointing",
        lambda c: c.parallel.activation_checkpointing is not ActivationCheckpointing.none,
        "parallel.pp_schedule",
        lambda c: _zero_bubble(c.parallel),
        "a zero-bubble schedule's stage is one FSDP unit, with no blocks to recompute; use 1F1B "
        "or Interleaved1F1B",
        yet=True,
        example=("parallel.activation_checkpointing=full", f"{_PP}=2", _ZERO_BUBBLE),
    ),
    Refusal(
        "eval.every",
        lambda c: c.eval.every > 0,
        "parallel.pp_schedule",
        lambda c: _zero_bubble(c.parallel),
        "torch 2.15's zero-bubble schedules have no forward-only pass; use 1F1B or "
        "Interleaved1F1B, or eval.every=0",
        example=("eval.every=2", "eval.path={tmp}/val.bin", f"{_PP}=2", _ZERO_BUBBLE),
    ),
    Refusal(
        "model.task",
        lambda c: c.model.task is not Task.causal_lm,
        _PP,
        lambda c: c.parallel.pp_size > 1,
        "the pipeline's stages run model.task=causal_lm only",
        example=("model.task=custom", "model.loss=tests.user_model:overflow_on_rank1", f"{_PP}=2"),
    ),
    Refusal(
        "model.pretrained",
        lambda c: c.model.pretrained is not None,
        _PP,
        lambda c: c.parallel.pp_size > 1,
        "a Hugging Face model passes keyword tensors (attention masks, rotary embeddings) between "
        "its layers, which a stage boundary does not carry; use parallel.tp_size",
        example=("model.pretrained={tmp}", f"{_PP}=2"),
    ),
    Refusal(
        "model.tie_embeddings",
        lambda c: _builtin_tied(c.model),
        _PP,
        lambda c: c.parallel.pp_size > 1,
        "the embedding lives on the first stage, the head on the last; set "
        "model.tie_embeddings=false",
        example=("model.tie_embeddings=true", f"{_PP}=2"),
    ),
    # the tiled loss: causal_lm's head, whole on the rank that computes the loss
    *(
        Refusal(
            "train.loss_chunk",
            lambda c: c.train.loss_chunk > 0,
            key,
            bad,
            why,
            yet=yet,
            example=("train.loss_chunk=64", *ex),
        )
        for key, bad, why, yet, ex in (
            (
                "model.task",
                lambda c: c.model.task is not Task.causal_lm,
                "it tiles model.task=causal_lm's head and cross-entropy; valid: causal_lm",
                False,
                ("model.task=custom", "model.loss=tests.user_model:overflow_on_rank1"),
            ),
            (
                _TP,
                lambda c: c.parallel.tp_size > 1,
                "the head's weight is split over the tensor-parallel ranks (parallel.loss_parallel "
                "keeps its logits split instead)",
                True,
                (f"{_TP}=2",),
            ),
            (
                _PP,
                lambda c: c.parallel.pp_size > 1,
                "the last stage's loss is given the head's logits, not the head",
                True,
                (f"{_PP}=2",),
            ),
        )
    ),
    # a run that stops early continues from its checkpoint
    *(
        Refusal(
            key,
            lambda c, key=key: getattr(c.train, key.split(".")[1]) is not None,
            "checkpoint.enabled",
            lambda c: not c.checkpoint.enabled,
            "a run stopped early continues from its checkpoint; set checkpoint.enabled=true",
            example=(f"{key}=3", "checkpoint.enabled=false"),
        )
        for key in ("train.stop_after", "train.max_minutes")
    ),
)


def setting(cfg: object, key: str) -> str:
    """``key``'s value in ``cfg`` as a config file spells it (true, null, bf16-mixed)."""
    value = cfg
    for name in key.split("."):
        value = getattr(value, name)
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    return str(value.value if isinstance(value, enum.Enum) else value)


def check_refusals(cfg: Config, when: str | None = None) -> None:
    """The first row of `REFUSALS` (of those whose ``when`` is ``when``, if given) that ``cfg`` trips.

    Raises:
        ValueError: ``{when}={value} with {refuses}={value} is not supported[ yet]: {why}``.
    """
    for row in REFUSALS:
        if (when is None or row.when == when) and row.active(cfg) and row.bad(cfg):
            yet = " yet" if row.yet else ""
            raise ValueError(
                f"{row.when}={setting(cfg, row.when)} with {row.refuses}="
                f"{setting(cfg, row.refuses)} is not supported{yet}: {row.why}"
            )


def refusal_matrix() -> str:
    """`REFUSALS` as a Markdown matrix (a row per ``when`` key, a column per ``refuses`` key, each
    refusal's number in its cell), then each number's reason."""
    whens = list(dict.fromkeys(r.when for r in REFUSALS))
    refused = list(dict.fromkeys(r.refuses for r in REFUSALS))
    cells = {(w, r): [] for w in whens for r in refused}
    for i, row in enumerate(REFUSALS, 1):
        cells[row.when, row.refuses].append(str(i))
    lines = [
        "| when ↓ refuses → | " + " | ".join(f"`{r}`" for r in refused) + " |",
        "|---|" + "---|" * len(refused),
    ]
    for w in whens:
        marks = [", ".join(cells[w, r]) for r in refused]
        lines.append(f"| `{w}` | " + " | ".join(marks) + " |")
    lines.append("")
    for i, row in enumerate(REFUSALS, 1):
        yet = " (not yet)" if row.yet else ""
        lines.append(f"{i}. `{row.when}` with `{row.refuses}`{yet}: {row.why}")
    return "\n".join(lines)


def validate(cfg: Config) -> None:
    """Every section's ``check()``, `REFUSALS`, and the rules where one value must fit another. The
    built-in model's rules are `fsdp_zero.config.presets.check_model_config`'s
    (`fsdp_zero.config.loader.load_config` runs both); those that need the world size run when a
    run is set up (`Topology.of`, `BatchLayout.of`).

    Raises:
        ValueError: naming the key, the bad value and the valid choices.
    """
    cfg.model.check()
    # before data.check(): with the wrong source, its path is moot
    _refuse(_source_feeds(cfg.model.task, cfg.data.source))
    for section in (
        cfg.data,
        cfg.train,
        cfg.dist,
        cfg.optim,
        cfg.offload,
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
    check_refusals(cfg)
    needs = {
        "model.lora.quantize": cfg.model.lora.quantize,
        "optim.state_bits": cfg.optim.state_bits,
        "precision.float8": cfg.precision.float8,
    }
    _refuse(
        _nf4_base(cfg.model)
        or _torchao_missing(needs)
        or _mxfp8_blocks(cfg.precision, cfg.train, cfg.data)
        or _splits(cfg.parallel, cfg.model, cfg.data)
        or _sequence_slices(cfg.parallel, cfg.model, cfg.data)
    )


def _refuse(problem: str | None) -> None:
    if problem:
        raise ValueError(problem)


# The data sources each task reads.
_TASK_SOURCES = {
    Task.causal_lm: TOKEN_SOURCES,
    Task.classification: (DataSource.images, DataSource.fake_images),
}


def _source_feeds(task: Task, source: DataSource) -> str | None:
    sources = _TASK_SOURCES.get(task)
    if sources and source not in sources:
        return (
            f"data.source={source.value} does not feed model.task={task.value}; "
            f"valid choices: {', '.join(s.value for s in sources)}"
        )
    return None


def _nf4_base(m: ModelConfig) -> str | None:
    """model.lora.quantize=nf4 quantizes a pretrained base (and rebuilds from it on resume and
    export). The rules that need the model and the world size (whole NF4 blocks per shard, two
    shards at least) are `fsdp_zero.sharding.quantize.check_nf4`'s."""
    if m.lora.quantize is Quantize.none or m.pretrained is not None or m.init_from is not None:
        return None
    return (
        f"model.lora.quantize={m.lora.quantize.value} quantizes a pretrained base, and none is "
        "given: set model.pretrained (a Hugging Face folder) or model.init_from (a state dict file)"
    )


def _torchao_missing(needs: dict[str, object]) -> str | None:
    """The keys that need torchao (the ``lowbit`` extra) find it installed."""
    used = {k: v for k, v in needs.items() if v not in ("none", 32)}
    if not used or importlib.util.find_spec("torchao") is not None:
        return None
    key, value = next(iter(used.items()))
    shown = value.value if isinstance(value, enum.Enum) else value
    return f"{key}={shown} needs torchao, which is not installed: pip install 'fsdp-zero[lowbit]'"


def _mxfp8_blocks(p: PrecisionConfig, train: TrainConfig, data: DataConfig) -> str | None:
    """MXFP8's micro-batch a whole number of its 32-value blocks. (Compile with emulation is refused
    when the device is known: `fsdp_zero.sharding.quantize.plan_float8`.)"""
    tokens = train.micro_batch_size * (data.seq_len if data.source in TOKEN_SOURCES else 1)
    if p.float8 != Float8Recipe.mxfp8 or tokens % 32 == 0:
        return None
    return (
        f"precision.float8={p.float8}: a micro-batch of {tokens} tokens (train.micro_batch_size x "
        "data.seq_len) is not a multiple of MXFP8's blocks of 32; change either"
    )


def _builtin_args(m: ModelConfig) -> TransformerArgs | None:
    """The built-in model's settings; None for a model.target or model.pretrained model (its own
    plans are checked against it when it is built: sharding/tensor.py, sharding/pipeline.py)."""
    if m.target is not None or m.pretrained is not None:
        return None
    return model_args(m.preset, **{name: getattr(m, name) for name in BUILTIN_FIELDS})


def _splits(par: ParallelConfig, m: ModelConfig, data: DataConfig) -> str | None:
    """The built-in model's dimensions that tensor parallelism splits, each divisible by tp_size
    (heads and KV heads: attention's colwise wq/wk/wv; the feed-forward's hidden size; the
    vocabulary: the embedding's rows and the output's columns; with sequence parallelism, the
    sequence), and at least one layer a pipeline stage."""
    args, tp = _builtin_args(m), par.tp_size
    if args is None:
        return None
    split = {
        "model.n_heads": args.n_heads,
        "model.n_kv_heads": args.kv_heads,
        "model.ffn_hidden_dim": args.hidden_dim,
        "model.vocab_size": args.vocab_size,
    }
    if par.sequence_parallel:
        split["data.seq_len"] = data.seq_len
    for key, value in split.items():
        if tp > 1 and value % tp:
            hint = "; or set parallel.sequence_parallel=false" if key == "data.seq_len" else ""
            return (
                f"{key}={value} must be a multiple of parallel.tp_size={tp} (each rank takes 1/{tp} "
                f"of it){hint}"
            )
    stages = par.pp_size * par.stages_per_rank
    if par.pp_size > 1 and args.n_layers < stages:
        return (
            f"model.n_layers={args.n_layers} cannot fill {stages} pipeline stages "
            f"(parallel.pp_size={par.pp_size} x parallel.pp_stages_per_rank={par.stages_per_rank}); "
            "each stage holds at least one layer"
        )
    return None


def _sequence_slices(par: ParallelConfig, m: ModelConfig, data: DataConfig) -> str | None:
    """Sequence parallelism's cuts: the sequence into sp_size slices, and (the built-in model's;
    others' when they are built, `fsdp_zero.sharding.sequence.check_heads`) the heads and KV heads
    into sp_size shares."""
    sp = par.sp_size
    if sp == 1:
        return None
    if data.seq_len % sp:
        valid = [d for d in range(1, sp * 4 + 1) if data.seq_len % d == 0][:8]
        return (
            f"parallel.sp_size={sp} must divide data.seq_len={data.seq_len} (each rank holds "
            f"1/{sp} of every sequence); sp sizes that divide it: {valid}"
        )
    args = _builtin_args(m)
    for key, value in (
        (("model.n_heads", args.n_heads), ("model.n_kv_heads", args.kv_heads)) if args else ()
    ):
        if value % sp:
            return (
                f"{key}={value} must be a multiple of parallel.sp_size={sp} (each rank attends "
                f"with 1/{sp} of the heads)"
            )
    return None
