"""A DeepSpeed JSON config, read as-is: ``scripts/train.py --deepspeed ds_config.json [key=value ...]``.

`read_deepspeed` turns the JSON a DeepSpeed user already has into our ``key=value`` overrides
(applied after ``--config`` and before the command line's own, so those win) and one printed
line for every key that has no effect here, saying what fsdp-zero does instead. A key DeepSpeed
does not know, a value we cannot honour (parameters on NVMe, quantized communication, an optimizer
other than Adam/AdamW), a value of the wrong kind (NaN, a fraction where a count goes) or a
contradiction (a batch that does not divide) is a ValueError naming the key. ``"auto"`` (which
only the Hugging Face and Accelerate integrations resolve) means: ours to decide; the batch sizes
are then derived as DeepSpeed derives them, other values keep our defaults, and each is listed.

Each key we read is a `_Rule` row: the DeepSpeed key, ours, the converter that checks its value,
and what it means. `TABLE` holds them in the order their overrides are printed; a row read on its
own applies itself, and rows that only mean something together (the batch arithmetic, ZeRO's
layout, offload, precision, the schedule) are read by one named function each (a `_Joint`). The
docs/deepspeed.md's table is `mapping_table()`, built from the same rows.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fsdp_zero.config.choices import StateTier
from fsdp_zero.config.ds_values import (
    Convert,
    bad,
    choice,
    flag,
    folder,
    is_auto,
    number,
    pair,
    text,
)
from fsdp_zero.config.schema import OptimConfig
from fsdp_zero.config.strategies import ZERO_STAGES, is_fsdp

# The one place that knows what a ZeRO stage is here: stage -> our strategy's name.
_STAGES = {stage: strategy.value for stage, strategy in ZERO_STAGES.items()}
# Our keys that the table writes in short form: config.load_config reads ``precision=MODE`` as
# ``precision.mode=MODE`` (config._apply_aliases).
_SHORTHAND = {"precision": "precision.mode"}

# What offload_param's NVMe pool sizes stand for here.
_HOST_SHARDS = "FSDP2's CPU offload keeps every parameter shard in host memory (no NVMe pool)"
# How offload.states=disk does its I/O (`fsdp_zero.sharding.offload._DiskStore`), for aio's keys.
_OUR_IO = (
    "one I/O thread per rank (preadv/pwritev, no libaio), each file synced and dropped from the "
    "page cache after its group"
)
# Keys FSDP2 handles differently or makes unnecessary: what fsdp-zero does instead.
_NO_EFFECT = {
    "overlap_comm": "FSDP2 overlaps all-gathers and reduce-scatters with compute on its own streams",
    "contiguous_gradients": "FSDP2 reduce-scatters each unit's gradients from one flat buffer",
    "reduce_bucket_size": "FSDP2 reduces one unit (wrap plan) at a time; the units are the buckets",
    "allgather_bucket_size": "FSDP2 all-gathers one unit at a time; the units are the buckets",
    "allgather_partitions": "FSDP2 always all-gathers a unit's shards as one collective",
    "reduce_scatter": "FSDP2 always reduce-scatters gradients",
    "round_robin_gradients": "no effect with FSDP2",
    "stage3_prefetch_bucket_size": "FSDP2 prefetches the next unit; explicit depth: parallel.prefetch",
    "stage3_param_persistence_threshold": "every unit is sharded; small units: parallel.wrap.min_params",
    "stage3_max_live_parameters": "at most the gathered units of the current and the prefetched ones live",
    "stage3_max_reuse_distance": "FSDP2 frees a unit's gathered parameters after its forward (ZeRO-3) or backward",
    "stage3_gather_16bit_weights_on_model_save": "scripts/export.py writes full weights (safetensors) of a checkpoint",
    "gather_16bit_weights_on_model_save": "scripts/export.py writes full weights (safetensors) of a checkpoint",
    "elastic_checkpoint": "DCP checkpoints load at any world size",
    "ignore_unused_parameters": "FSDP2 handles parameters without gradients",
    "load_from_fp32_weights": "checkpoints hold the fp32 master weights",
    "memory_efficient_linear": "no effect with FSDP2",
    "offload_optimizer.fast_init": "the states' files are allocated as zeros at start-up",
    "offload_optimizer.pipeline_read": "the next offload.prefetch groups are always read ahead",
    "offload_optimizer.pipeline_write": "each group is always written back behind the next step",
    "offload_optimizer.super_offload": "AdamW steps where its parameters are (device or host)",
    "offload_optimizer.cpuadam_cores_perc": "torch's AdamW on torch's threads, where on the host",
    "offload_param.pin_memory": "FSDP2's CPU offload pins the host shards on CUDA",
    "offload_param.nvme_path": "parameters stay in memory (offload_param.device: cpu or none)",
    "offload_param.buffer_count": _HOST_SHARDS,
    "offload_param.buffer_size": _HOST_SHARDS,
    "offload_param.max_in_cpu": _HOST_SHARDS,
    "fp16.hysteresis": "the scale halves on every overflow (torch's GradScaler)",
    "fp16.min_loss_scale": "no floor: the scale halves on every overflow (torch's GradScaler)",
    "fp16.consecutive_hysteresis": "the scale halves on every overflow (torch's GradScaler)",
    "fp16.auto_cast": "FSDP2 casts each unit's floating inputs to the compute dtype",
    "bf16.immediate_grad_update": "gradients are reduced in precision.reduce_dtype (fp32) into fp32 shards",
    "zero_allow_untested_optimizer": "AdamW only",
    "zero_force_ds_cpu_optimizer": "torch's AdamW steps on the CPU under offload",
    "prescale_gradients": "FSDP2 averages gradients in the reduction",
    "gradient_predivide_factor": "FSDP2 averages gradients in the reduction",
    "memory_breakdown": "the memory breakdown is logged at memory.profile_step",
    "flops_profiler": "no flops profiler; tokens/s are logged",
    "activation_checkpointing": "configures DeepSpeed's checkpointing API for model code; use "
    "parallel.activation_checkpointing=full|selective (cpu_checkpointing: "
    "parallel.activation_offload=true)",
    "tensorboard.output_path": "TensorBoard events go to <run dir>/tb (run.root, run.name)",
    "tensorboard.job_name": "TensorBoard events go to <run dir>/tb (run.root, run.name)",
    "scheduler.params.last_batch_iteration": "the learning rate is set from the step number on resume",
    "optimizer.params.torch_adam": "torch's AdamW",
    "optimizer.params.adam_w_mode": "AdamW (decoupled weight decay)",
    "optimizer.params.amsgrad": "AdamW without amsgrad",
    "dump_state": "the resolved config is printed and saved as config.yaml",
    # DeepSpeed's asynchronous I/O for NVMe offload (libaio, GPUDirect Storage)
    "aio.block_size": f"each group's file is read and written whole; {_OUR_IO}",
    "aio.queue_depth": f"one request in flight per rank; {_OUR_IO}",
    "aio.thread_count": _OUR_IO,
    "aio.intra_op_parallelism": _OUR_IO,
    "aio.single_submit": _OUR_IO,
    "aio.overlap_events": f"reads ahead and writes behind overlap the step; {_OUR_IO}",
    "aio.use_gds": "no GPUDirect Storage: files go through host buffers (offload.pin_memory)",
}
# Keys whose values we cannot honour, with the valid choices.
_UNSUPPORTED = {
    "zero_quantized_weights": "ZeRO++ quantized weights: not supported (valid: false)",
    "zero_quantized_gradients": "ZeRO++ quantized gradients: not supported (valid: false)",
    "zero_quantized_nontrainable_weights": "not supported (valid: false)",
    "amp": "apex AMP: not supported; use fp16 or bf16",
    "pipeline": "pipeline parallelism: not supported",
    "sparse_attention": "not supported",
    "compression_training": "not supported",
    "elasticity": "DeepSpeed elasticity: not supported (see torchrun --max-restarts)",
    "autotuning": "not supported",
    "data_efficiency": "not supported",
    "curriculum_learning": "not supported",
}
_SCHEDULES = {"WarmupLR": "constant", "WarmupDecayLR": "linear", "WarmupCosineLR": "cosine"}


@dataclass
class _Reader:
    """The flattened JSON, each value read through its row's converter, and the notes rules add."""

    flat: dict[str, Any]
    world_size: int
    notes: list[str] = field(default_factory=list)

    def __getitem__(self, rule: _Rule) -> Any:
        """The converted value of ``rule``'s key; None where it is absent, null or "auto" (ours to decide)."""
        value = self.raw(rule.ds)
        return None if value is None else rule.convert(rule.ds, value)

    def raw(self, key: str) -> Any:
        value = self.flat.get(key)
        return None if is_auto(value) else value

    def bad(self, key: str, why: str) -> ValueError:
        return bad(key, self.flat.get(key), why)


@dataclass(frozen=True)
class _Rule:
    """One DeepSpeed key with an equivalent here: a row of docs/deepspeed.md's table.

    Attributes:
        ds: the DeepSpeed key, dotted (``zero_optimization.stage``).
        ours: the key of ours it sets, as docs/deepspeed.md shows it: ``key``, ``key=value`` (the
            value is fixed), several of them joined by ", ", or ``(...)`` when it sets none (why, in
            brackets).
        convert: checks and converts the JSON value (see `number`, `flag`, `choice`).
        meaning: the table's last column.
    """

    ds: str
    ours: str
    convert: Convert
    meaning: str = ""

    @property
    def rules(self) -> tuple[_Rule, ...]:
        return (self,)

    @property
    def targets(self) -> tuple[str, ...]:
        """The dotted keys of `Config` this row sets, shorthand resolved (``precision`` -> ``precision.mode``)."""
        return tuple(key for key, _ in self._parts())

    def overrides(self, value: Any = None) -> list[str]:
        """Our ``key=value`` overrides: a key ``ours`` fixes keeps its value, any other gets ``value``."""
        assert self.targets, f"{self.ds} sets none of our keys"
        return [f"{key}={text(value) if fixed is None else fixed}" for key, fixed in self._parts()]

    def _parts(self) -> list[tuple[str, str | None]]:
        if self.ours.startswith("("):
            return []
        parts = [part.partition("=") for part in self.ours.split(", ")]
        return [(_SHORTHAND.get(key, key), fixed if eq else None) for key, eq, fixed in parts]

    def __call__(self, ds: _Reader) -> list[str]:
        """A row read on its own: its value, when given, is ours."""
        value = ds[self]
        return [] if value is None else self.overrides(value)


@dataclass(frozen=True)
class _Joint:
    """Rows that only mean something together, read by one named function into overrides."""

    read: Callable[[_Reader], list[str]]
    rules: tuple[_Rule, ...]

    def __call__(self, ds: _Reader) -> list[str]:
        return self.read(ds)


# Batch sizes.
_TRAIN_BATCH = _Rule(
    "train_batch_size",
    "train.global_batch_size",
    number(int, min=1),
    "samples per optimizer step over all ranks",
)
_MICRO_BATCH = _Rule(
    "train_micro_batch_size_per_gpu",
    "train.micro_batch_size",
    number(int, min=1),
    "samples per forward/backward on one rank",
)
_GRAD_ACCUM = _Rule(
    "gradient_accumulation_steps",
    "(derived)",
    number(int, min=1),
    "global / (micro x ranks); checked when all three are given",
)


def _batch(ds: _Reader) -> list[str]:
    """DeepSpeed's rule, train_batch_size = micro x accumulation x data-parallel ranks (the world
    size / AutoTP's and Ulysses' degrees, whose groups read one batch): any two give the third."""
    tbs, micro, gas = ds[_TRAIN_BATCH], ds[_MICRO_BATCH], ds[_GRAD_ACCUM]
    ranks = ds.world_size // ((ds[_AUTOTP] or 1) * (ds[_ULYSSES] or 1))
    if tbs is not None and micro is not None and gas is not None and tbs != micro * gas * ranks:
        raise ds.bad(
            _TRAIN_BATCH.ds,
            f"!= {_MICRO_BATCH.ds} {micro} x {_GRAD_ACCUM.ds} {gas} x {ranks} ranks = "
            f"{micro * gas * ranks}",
        )
    if tbs is None and micro is not None:
        tbs = micro * (gas or 1) * ranks
    if micro is None and tbs is not None:
        per = (gas or 1) * ranks
        if tbs % per:
            raise ds.bad(
                _TRAIN_BATCH.ds, f"does not divide over {_GRAD_ACCUM.ds} {gas or 1} x {ranks} ranks"
            )
        micro = tbs // per
    return [] if tbs is None else _TRAIN_BATCH.overrides(tbs) + _MICRO_BATCH.overrides(micro)


# AutoTP: the model's layers split over groups of autotp_size ranks (here: the model's own plan).
_AUTOTP = _Rule(
    "tensor_parallel.autotp_size", "parallel.tp_size", number(int, min=1), "AutoTP's degree"
)

# Ulysses sequence parallelism (ALST): each sequence cut over groups of sequence_parallel_size ranks.
_ULYSSES = _Rule(
    "sequence_parallel_size",
    "parallel.sp_size",
    number(int, min=1),
    "Ulysses' degree (ALST): each sequence cut over this many ranks",
)


# ZeRO: the stage, CPU offload, and the groups of hpZ and MiCS.
_STAGE = _Rule(
    "zero_optimization.stage",
    "parallel.zero_stage",
    number(int, choices=_STAGES),
    ", ".join(f"{stage} {name}" for stage, name in _STAGES.items()),
)
# Offload. DeepSpeed's offload_optimizer keeps AdamW's states (and steps them, its CPU Adam) in host
# memory or on NVMe; here they live in offload.states' tier and are swapped onto the device, step
# group by step group (sub_group_size), for a step there. offload_param is FSDP2's CPU offload:
# parameters, gradients, AdamW's states and its step on the host.
_OFFLOAD_OPTIMIZER = _Rule(
    "zero_optimization.offload_optimizer.device",
    "offload.states",
    choice(
        {"cpu": StateTier.cpu.value, "nvme": StateTier.disk.value, "none": StateTier.none.value},
    ),
    "cpu: AdamW's moments in host memory (ZeRO-Offload); nvme: in a file under nvme_path "
    "(ZeRO-Infinity); swapped onto the device group by group (sub_group_size) and stepped there; "
    "cpu with offload_param cpu: parallel.cpu_offload alone, which holds them on the host already",
)
_NVME_PATH = _Rule(
    "zero_optimization.offload_optimizer.nvme_path",
    "offload.path",
    folder,
    "required with nvme: a folder on a local disk; each rank's files in a folder of its own under "
    "it, removed at the end of the run",
)
_RATIO = _Rule(
    "zero_optimization.offload_optimizer.ratio",
    "offload.ratio",
    number(float, min=0, max=1),
    "the fraction of step groups offloaded, the last ones (Twin-Flow); the others' states stay on "
    "the device",
)
# DeepSpeed's buffer_count counts pinned buffers of one tensor each: its swapper takes 4 a sub-group
# in flight (the fp32 parameter, exp_avg, exp_avg_sq and the gradient; two sub-groups, 8, under
# pipeline_read/write: deepspeed/runtime/swap_tensor/partitioned_optimizer_swapper.py). Ours hold a
# step group's two moments each, offload.prefetch + 1 groups. So buffer_count // 4 groups in flight,
# at least 2 here (one read ahead): DeepSpeed's default 4 is our default prefetch 1, where
# buffer_count - 1 would keep 4 groups in flight for DeepSpeed's 1.
_DS_BUFFERS_PER_GROUP = 4


def _prefetch(key: str, value: Any) -> int:
    """offload.prefetch for DeepSpeed's buffer_count: groups in flight, less the one stepping."""
    return max(1, number(int, min=0)(key, value) // _DS_BUFFERS_PER_GROUP - 1)


_BUFFER_COUNT = _Rule(
    "zero_optimization.offload_optimizer.buffer_count",
    "offload.prefetch",
    _prefetch,
    f"max(1, buffer_count // {_DS_BUFFERS_PER_GROUP} - 1): DeepSpeed's buffers hold a tensor each, "
    f"{_DS_BUFFERS_PER_GROUP} a sub-group in flight; ours a group's moments, prefetch + 1 groups",
)
_PIN = _Rule(
    "zero_optimization.offload_optimizer.pin_memory",
    "offload.pin_memory",
    flag,
    "host buffers pinned on CUDA",
)
# The settings of offload_optimizer that mean something only with its device cpu or nvme.
_OFFLOAD_SETTINGS = (_NVME_PATH, _RATIO, _BUFFER_COUNT, _PIN)


def _param_device(key: str, value: Any) -> bool:
    """Whether the parameters go to the host: ``cpu``, or ``none`` (in any case)."""
    name = value.lower() if isinstance(value, str) else value
    if name == "nvme":
        raise bad(
            key,
            value,
            "parameters on disk are not supported under FSDP2, which all-gathers each unit from "
            "its resident shard (docs/deepspeed.md); valid choices: cpu, none",
        )
    if name not in ("cpu", "none"):
        raise bad(key, value, "valid choices: cpu, none")
    return name == "cpu"


_OFFLOAD_PARAM = _Rule(
    "zero_optimization.offload_param.device",
    "parallel.cpu_offload",
    _param_device,
    "cpu: FSDP2's CPU offload (parameter shards, gradients, AdamW's states and its step on the "
    "host); nvme: an error",
)
_HPZ = _Rule(
    "zero_optimization.zero_hpz_partition_size",
    "parallel.reshard_after_forward",
    number(int, min=1),
    "ZeRO++ hpZ group size",
)
_MICS = _Rule(
    "zero_optimization.mics_shard_size",
    "parallel.strategy=hybrid_shard, parallel.shard_size",
    number(int),
    "MiCS = HSDP",
)


def _zero(ds: _Reader) -> list[str]:
    """The stage, offload, hpZ (1: off) and MiCS (-1, DeepSpeed's default: off).

    MiCS shards within groups of ``mics_shard_size`` ranks: FSDP2's hybrid sharding, a strategy of
    its own that replaces the stage's (both would contradict each other in `load_config`).
    """
    stage = ds[_STAGE]
    offload = _offload(ds, stage)
    hpz, mics = ds[_HPZ], ds[_MICS]
    hybrid = mics is not None and mics > 0
    out = [] if stage is None or hybrid else _STAGE.overrides(stage)
    out += offload
    if hpz is not None and hpz > 1:
        out += _HPZ.overrides(hpz)
    if hybrid:
        out += _MICS.overrides(mics)
    return out


def _offload(ds: _Reader, stage: int | None) -> list[str]:
    """offload_param cpu is parallel.cpu_offload; offload_optimizer cpu or nvme is offload.states
    cpu or disk with its settings, except cpu under parallel.cpu_offload, which holds AdamW's states
    on the host already (config.rules refuses the two together). Only the sharded strategies honour
    either; settings that then mean nothing are noted."""
    tier, on_host = StateTier(ds[_OFFLOAD_OPTIMIZER] or "none"), bool(ds[_OFFLOAD_PARAM])
    asked = (
        _OFFLOAD_OPTIMIZER if tier is not StateTier.none else _OFFLOAD_PARAM if on_host else None
    )
    if asked and stage is not None and not is_fsdp(ZERO_STAGES[stage]):
        fsdp = " or ".join(str(s) for s, strategy in ZERO_STAGES.items() if is_fsdp(strategy))
        raise ds.bad(asked.ds, f"offload needs ZeRO stage {fsdp} here (FSDP2); {_STAGE.ds}={stage}")
    why = f"{_OFFLOAD_OPTIMIZER.ds} is {ds.raw(_OFFLOAD_OPTIMIZER.ds) or 'none'}"
    if tier is StateTier.cpu and on_host:
        tier = StateTier.none
        why += f" under {_OFFLOAD_PARAM.ds} cpu (parallel.cpu_offload: the states on the host)"
    if tier is StateTier.disk and ds[_NVME_PATH] is None:
        raise ds.bad(_OFFLOAD_OPTIMIZER.ds, f"needs {_NVME_PATH.ds}, a folder on a local disk")
    used = {StateTier.cpu: _OFFLOAD_SETTINGS[1:], StateTier.disk: _OFFLOAD_SETTINGS}.get(tier, ())
    for rule in _OFFLOAD_SETTINGS:
        if (value := ds.raw(rule.ds)) is not None and rule not in used:
            ds.notes.append(f"ds_config {rule.ds}={json.dumps(value)}: no effect; {why}")
    out = _OFFLOAD_PARAM.overrides(True) if on_host else []
    out += _OFFLOAD_OPTIMIZER.overrides(tier.value) if used else []
    return out + [o for rule in used if (v := ds[rule]) is not None for o in rule.overrides(v)]


def _sub_group(key: str, value: Any) -> int:
    """Elements per optimizer sub-group; DeepSpeed's 0 (every tensor a sub-group of its own) is 1 here."""
    return max(number(int, min=0)(key, value), 1)


# DeepSpeed's ZeRO-3 steps its optimizer sub-group by sub-group (default 1e9 elements: one group for
# any shard below that); here foreach AdamW steps groups of at most that many, at every stage.
_SUB_GROUP = _Rule(
    "zero_optimization.sub_group_size",
    "optim.step_group_size",
    _sub_group,
    "elements of a rank's shard AdamW steps at once (bit-identical; bounds foreach AdamW's "
    "temporaries), and under offload_optimizer the swap unit: one group's states read, stepped "
    "and written back at a time; 0, one tensor at a time, is 1 here",
)


# Precision.
_FP16 = _Rule(
    "fp16.enabled", "precision=fp16-mixed", flag, "fp32 master weights, fp16 compute, loss scaling"
)
_LOSS_SCALE = _Rule("fp16.loss_scale", "precision.loss_scale", number(float, min=0), "0: dynamic")
_COUNT = number(int, min=0)
_SCALE_POWER = _Rule(
    "fp16.initial_scale_power", "precision.initial_scale_power", _COUNT, "first scale 2**power"
)
_SCALE_WINDOW = _Rule(
    "fp16.loss_scale_window", "precision.loss_scale_window", _COUNT, "clean steps before doubling"
)
BF16 = _Rule("bf16.enabled", "precision=bf16-mixed", flag, "fp32 master weights, bf16 compute")


def _precision(ds: _Reader) -> list[str]:
    """fp16 or bf16 (not both); fp16's loss-scale settings are checked always and set only with fp16."""
    fp16, bf16 = bool(ds[_FP16]), bool(ds[BF16])
    if fp16 and bf16:
        raise ds.bad(_FP16.ds, "fp16 and bf16 are both enabled; enable one")
    out = _FP16.overrides() if fp16 else BF16.overrides() if bf16 else []
    for rule in (_LOSS_SCALE, _SCALE_POWER, _SCALE_WINDOW):
        value = ds[rule]
        if value is not None and fp16:
            out += rule.overrides(value)
    return out


# Optimizer and schedule. DeepSpeed builds the JSON's optimizer (engine._configure_basic_optimizer)
# over the model_parameters given to deepspeed.initialize: by default the module's parameters() (the
# engine's own default, and what Hugging Face's Trainer and Accelerate pass: the trainable
# parameters), one group whose weight_decay decays every parameter, 1-D ones included. The JSON
# cannot say when a loop passed groups of its own instead (no decay on norms and biases):
# optim.decay_1d=false on the command line then, and scripts/import_deepspeed.py reads it from the
# checkpoint's groups.
_OPTIMIZER = _Rule(
    "optimizer.type",
    "optim.decay_1d=true",
    choice({"adam": "adam", "adamw": "adamw"}, "Adam, AdamW (fsdp-zero trains with AdamW)"),
    "Adam and AdamW (DeepSpeed's Adam is AdamW unless adam_w_mode=false), built over model.parameters(): "
    "weight decay on every parameter, 1-D ones (norms, biases) too; a loop that passed deepspeed.initialize "
    "groups without decay on them: optim.decay_1d=false",
)


def _adam(ds: _Reader) -> list[str]:
    """DeepSpeed's Adam is AdamW unless ``adam_w_mode`` is false (L2 regularisation, which we lack);
    built from the JSON, it decays every parameter (``optim.decay_1d``), and the settings the JSON
    leaves out are its optimizer's defaults, not ours (see `_EPS`)."""
    kind = ds[_OPTIMIZER]
    if kind == "adam" and ds.raw("optimizer.params.adam_w_mode") is False:
        raise ds.bad(
            "optimizer.params.adam_w_mode",
            "Adam with L2 regularisation is not supported; valid: true (AdamW)",
        )
    if kind is None:
        return []
    # absent, not "auto": "auto" (Hugging Face's) leaves the value to our settings
    torch_adam = bool(ds.raw("optimizer.params.torch_adam"))
    defaults = ((_WEIGHT_DECAY, 0.01 if torch_adam else 0.0), (_BETAS, [0.9, 0.999]), (_EPS, 1e-8))
    return _OPTIMIZER.overrides() + [
        o for rule, value in defaults if rule.ds not in ds.flat for o in rule.overrides(value)
    ]


# What DeepSpeed's Adam(W) uses where the JSON's params leave a setting out
# (engine._configure_basic_optimizer): FusedAdam (its default on GPUs) and DeepSpeedCPUAdam
# (ZeRO-Offload) decay by 0, torch's AdamW (torch_adam: true) by 0.01; all three take betas (0.9,
# 0.999) and eps 1e-8 (`_adam`). Ours differ (0.1, [0.9, 0.95]).
_EPS = _Rule("optimizer.params.eps", "optim.eps", number(float, min=0))
_WEIGHT_DECAY = _Rule(
    "optimizer.params.weight_decay", "optim.weight_decay", number(float, min=0), "decoupled (AdamW)"
)
_BETAS = _Rule("optimizer.params.betas", "optim.betas", pair)


LR = _Rule("optimizer.params.lr", "optim.lr", number(float, min=0), "peak learning rate")
_SCHEDULER = _Rule(
    "scheduler.type",
    "optim.schedule",
    choice(_SCHEDULES, fold_case=False),
    "after the warm-up: WarmupLR constant, WarmupDecayLR linear to warmup_min_lr at total_num_steps, "
    "WarmupCosineLR cosine to cos_min_ratio",
)
_WARMUP = _Rule(
    "scheduler.params.warmup_num_steps",
    "optim.warmup_steps",
    number(int, min=0),
    "DeepSpeed's default 1000 when absent",
)
_WARMUP_TYPE = _Rule(
    "scheduler.params.warmup_type",
    "optim.warmup",
    choice({"log": "deepspeed_log", "linear": "deepspeed_linear"}, fold_case=False),
    "DeepSpeed's climb (default log) and step count, step for step",
)
_WARMUP_MAX_LR = _Rule(
    "scheduler.params.warmup_max_lr",
    "optim.lr",
    number(float, min=0),
    "WarmupLR (default: the optimizer's lr), WarmupDecayLR (default 0.001)",
)
_WARMUP_MIN_LR = _Rule(
    "scheduler.params.warmup_min_lr",
    "optim.warmup_start_ratio",
    number(float, min=0),
    "as a ratio of the peak; WarmupDecayLR also decays to it (optim.min_lr_ratio)",
)
_WARMUP_MIN_RATIO = _Rule(
    "scheduler.params.warmup_min_ratio",
    "optim.warmup_start_ratio",
    number(float, min=0),
    "WarmupCosineLR",
)
_TOTAL_STEPS = _Rule(
    "scheduler.params.total_num_steps", "train.steps", number(int, min=1), "the schedule's length"
)
_MIN_RATIO = _Rule(
    "scheduler.params.cos_min_ratio",
    "optim.min_lr_ratio",
    number(float, min=0),
    "WarmupCosineLR (default 0.0001)",
)
# DeepSpeed's defaults for what a scheduler block leaves out (deepspeed/runtime/lr_schedules.py)
_DS_WARMUP_STEPS, _DS_DECAY_PEAK, _DS_COS_MIN_RATIO = 1000, 0.001, 0.0001


def _schedule(ds: _Reader) -> list[str]:
    """The schedule and the peak LR; DeepSpeed reads scheduler.params only with a scheduler.type, and
    then its schedule is followed step for step (`fsdp_zero.training.step.lr_factor`), its defaults
    for what the block leaves out included.

    WarmupLR warms up to ``warmup_max_lr`` (default: the optimizer's lr) and stays there;
    WarmupDecayLR to ``warmup_max_lr`` (default 0.001), then straight down to ``warmup_min_lr`` at
    total_num_steps; WarmupCosineLR to the optimizer's lr, then a cosine down to ``cos_min_ratio``.
    """
    lr, schedule = ds[LR], ds[_SCHEDULER]
    if schedule is None:  # DeepSpeed without a scheduler steps at the optimizer's lr throughout
        constant = _SCHEDULER.overrides(_SCHEDULES["WarmupLR"]) + _WARMUP.overrides(0)
        return constant + ([] if lr is None else LR.overrides(lr))
    out = _SCHEDULER.overrides(schedule)
    cosine, decay = _SCHEDULES["WarmupCosineLR"], _SCHEDULES["WarmupDecayLR"]
    peak = ds[_WARMUP_MAX_LR]
    if schedule == decay and peak is None:
        peak = _DS_DECAY_PEAK
    if schedule != cosine and peak is not None:
        lr = peak
    warmup = ds[_WARMUP]
    out += _WARMUP.overrides(_DS_WARMUP_STEPS if warmup is None else warmup)
    out += _WARMUP_TYPE.overrides(ds[_WARMUP_TYPE] or "deepspeed_log")
    out += [] if (steps := ds[_TOTAL_STEPS]) is None else _TOTAL_STEPS.overrides(steps)
    if schedule == cosine:
        start = ds[_WARMUP_MIN_RATIO] or 0.0
        floor = ds[_MIN_RATIO]
        floor = _DS_COS_MIN_RATIO if floor is None else floor
    else:
        low = ds[_WARMUP_MIN_LR] or 0.0
        peak_lr = lr if lr is not None else OptimConfig().lr
        if low > peak_lr:
            raise ds.bad(
                "scheduler.params.warmup_min_lr",
                f"must be at most the peak learning rate {peak_lr}",
            )
        start = low / peak_lr
        floor = 1.0 if schedule == _SCHEDULES["WarmupLR"] else start
    out += _WARMUP_MIN_LR.overrides(start) + _MIN_RATIO.overrides(floor)
    return out + ([] if lr is None else LR.overrides(lr))


# DeepSpeed tests this top-level key for truth as written (get_scalar_param); it only adds a note
# here.
_WALL_CLOCK = _Rule(
    "wall_clock_breakdown",
    "(always on)",
    lambda key, value: bool(value),
    "step time and throughput are logged every train.log_every steps",
)


def _wall_clock(ds: _Reader) -> list[str]:
    if ds[_WALL_CLOCK]:
        ds.notes.append(
            "ds_config wall_clock_breakdown=true: step time and tokens/s are always logged (every "
            "train.log_every steps); the memory breakdown at memory.profile_step"
        )
    return []


# Every key we read, in the order its overrides are printed.
TABLE: tuple[_Rule | _Joint, ...] = (
    _Joint(_batch, (_TRAIN_BATCH, _MICRO_BATCH, _GRAD_ACCUM)),
    _AUTOTP,
    _ULYSSES,
    _Rule(
        "gradient_clipping", "optim.grad_clip", number(float, min=0), "max global L2 norm (0: off)"
    ),
    _Rule("steps_per_print", "train.log_every", number(int, min=0), "steps between log lines"),
    _Joint(_zero, (_STAGE, _OFFLOAD_OPTIMIZER, *_OFFLOAD_SETTINGS, _OFFLOAD_PARAM, _HPZ, _MICS)),
    _SUB_GROUP,
    _Joint(_precision, (_FP16, _LOSS_SCALE, _SCALE_POWER, _SCALE_WINDOW, BF16)),
    _Rule(
        "communication_data_type",
        "precision.reduce_dtype",
        choice(
            {
                "fp32": "fp32",
                "fp16": "fp16",
                "bf16": "bf16",
                "float32": "fp32",
                "float16": "fp16",
                "bfloat16": "bf16",
            }
        ),
        "gradient reduction dtype",
    ),
    _Joint(_adam, (_OPTIMIZER,)),
    _EPS,
    _WEIGHT_DECAY,
    _BETAS,
    _Joint(
        _schedule,
        (
            LR,
            _SCHEDULER,
            _WARMUP,
            _WARMUP_TYPE,
            _WARMUP_MAX_LR,
            _WARMUP_MIN_LR,
            _WARMUP_MIN_RATIO,
            _TOTAL_STEPS,
            _MIN_RATIO,
        ),
    ),
    _Joint(_wall_clock, (_WALL_CLOCK,)),
    _Rule("tensorboard.enabled", "metrics.tensorboard", flag),
)
# The rows, as docs/deepspeed.md lists them.
_MAPPED = tuple(rule for entry in TABLE for rule in entry.rules)
_MAPPED_KEYS = {rule.ds for rule in _MAPPED}


def _sections() -> dict[str, list[str]]:
    """Each section's keys we read or note, by which its unknown keys are answered. (`_NO_EFFECT`
    names zero_optimization's keys without it: ``offload_param.max_in_cpu`` is not a section's.)"""
    keys = [rule.ds for rule in _MAPPED] + list(_NO_EFFECT)
    nested = {
        k.split(".")[1] for k in keys if k.startswith("zero_optimization.") and k.count(".") > 1
    }
    out: dict[str, list[str]] = {}
    for key in keys:
        if "." in key and key.split(".")[0] not in nested:
            out.setdefault(key.split(".")[0], []).append(key)
    return out


_SECTIONS = _sections()


def _flatten(node: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in node.items():
        full = f"{prefix}{key}"
        if isinstance(value, dict) and full not in _UNSUPPORTED and full not in _NO_EFFECT:
            out |= _flatten(value, f"{full}.")
        else:
            out[full] = value
    return out


def _tail(key: str) -> str:
    """A zero_optimization key without its section (the tables list those by their own name)."""
    return key.split(".", 1)[-1] if key.startswith("zero_optimization.") else key


def _known(key: str) -> bool:
    return key in _MAPPED_KEYS or any(
        k in _NO_EFFECT or k in _UNSUPPORTED for k in (key, _tail(key))
    )


def _load(path: str | Path) -> dict[str, Any]:
    """The JSON object in ``path``, its keys flattened (``zero_optimization.stage``)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--deepspeed: file not found: {str(path)!r}")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"--deepspeed {str(path)!r}: not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"--deepspeed {str(path)!r}: must hold a JSON object of DeepSpeed keys")
    return _flatten(raw)


def _check_keys(flat: dict[str, Any]) -> list[str]:
    """Unknown keys and unsupported values are errors; keys without effect, and "auto", are noted."""
    notes = []
    for key, value in flat.items():
        if not _known(key):
            section = key.split(".")[0]
            hint = (
                f"; keys of '{section}' read here: " + ", ".join(_SECTIONS[section])
                if section in _SECTIONS
                else ""
            )
            raise bad(key, value, f"unknown DeepSpeed key{hint}")
        tail = _tail(key)
        if key in _UNSUPPORTED or tail in _UNSUPPORTED:
            if value in (False, None, 0) or (
                isinstance(value, dict) and not value.get("enabled", True)
            ):
                continue
            raise bad(key, value, _UNSUPPORTED.get(key) or _UNSUPPORTED[tail])
        if key in _NO_EFFECT or tail in _NO_EFFECT:
            notes.append(
                f"ds_config {key}={json.dumps(value)}: no effect; "
                f"{_NO_EFFECT.get(key) or _NO_EFFECT[tail]}"
            )
        elif is_auto(value):
            notes.append(f"ds_config {key}=auto: fsdp-zero's value is used")
    return notes


def read_deepspeed(path: str | Path | dict, world_size: int) -> tuple[list[str], list[str]]:
    """The overrides a DeepSpeed config stands for, and one note per key without effect or left to us.

    Args:
        path: the DeepSpeed JSON file (or its object, as a DeepSpeed checkpoint keeps it).
        world_size: the number of ranks, for DeepSpeed's batch arithmetic.

    Returns:
        Our ``key=value`` overrides, in `TABLE`'s order, and the notes to print.

    Raises:
        ValueError: a missing or malformed file, an unknown key, a value of the wrong kind, an
            unsupported value, or a contradiction; one line naming the key (as ``ds_config <key>``),
            the value and the valid choices.
    """
    flat = _flatten(path) if isinstance(path, dict) else _load(path)
    notes = _check_keys(flat)
    ds = _Reader(flat, world_size)
    overrides = [override for entry in TABLE for override in entry(ds)]
    return overrides, notes + ds.notes


def mapping_table() -> str:
    """docs/deepspeed.md's table: each DeepSpeed key and ours, then the keys without effect."""
    rows = ["| DeepSpeed key | fsdp-zero | meaning |", "|---|---|---|"]
    rows += [f"| `{rule.ds}` | `{rule.ours}` | {rule.meaning} |" for rule in _MAPPED]
    rows += [f"| `{ds}` | no effect | {why} |" for ds, why in _NO_EFFECT.items()]
    rows += [f"| `{ds}` | error unless off | {why} |" for ds, why in _UNSUPPORTED.items()]
    return "\n".join(rows)
