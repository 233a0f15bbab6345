"""A DeepSpeed JSON config, read as-is: ``scripts/train.py --deepspeed ds_config.json [key=value ...]``.

`read_deepspeed` turns the JSON a DeepSpeed user already has into our ``key=value`` overrides
(applied after ``--config`` and before the command line's own, so those win) and one printed
line for every key that has no effect here, saying what fsdp-zero does instead. A key DeepSpeed
does not know, a value we cannot honour (NVMe offload, quantized communication, an optimizer
other than Adam/AdamW) or a contradiction (a batch that does not divide) is a ValueError naming
the key. ``"auto"`` (which only the Hugging Face and Accelerate integrations resolve) means: ours
to decide; the batch sizes are then derived as DeepSpeed derives them, other values keep our
defaults, and each is listed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# Keys with an equivalent: (DeepSpeed key, ours, what it means here); the README's table is this one.
MAPPED = [
    ("train_batch_size", "train.global_batch_size", "samples per optimizer step over all ranks"),
    ("train_micro_batch_size_per_gpu", "train.micro_batch_size", "samples per forward/backward on one rank"),
    ("gradient_accumulation_steps", "(derived)", "global / (micro x ranks); checked when all three are given"),
    ("gradient_clipping", "optim.grad_clip", "max global L2 norm (0: off)"),
    ("steps_per_print", "train.log_every", "steps between log lines"),
    ("zero_optimization.stage", "parallel.zero_stage", "0 ddp, 1 zero1, 2 shard_grad_op, 3 full_shard"),
    ("zero_optimization.offload_optimizer.device", "parallel.cpu_offload", "cpu: shards and the optimizer step on the "
     "CPU (FSDP2 offloads parameters too)"),
    ("zero_optimization.offload_param.device", "parallel.cpu_offload", "cpu: as offload_optimizer"),
    ("zero_optimization.zero_hpz_partition_size", "parallel.reshard_after_forward", "ZeRO++ hpZ group size"),
    ("zero_optimization.mics_shard_size", "parallel.strategy=hybrid_shard, parallel.shard_size", "MiCS = HSDP"),
    ("communication_data_type", "precision.reduce_dtype", "gradient reduction dtype"),
    ("fp16.enabled", "precision=fp16-mixed", "fp32 master weights, fp16 compute, loss scaling"),
    ("fp16.loss_scale", "precision.loss_scale", "0: dynamic"),
    ("fp16.initial_scale_power", "precision.initial_scale_power", "first scale 2**power"),
    ("fp16.loss_scale_window", "precision.loss_scale_window", "steps without overflow before doubling"),
    ("bf16.enabled", "precision=bf16-mixed", "fp32 master weights, bf16 compute"),
    ("optimizer.type", "(AdamW)", "Adam and AdamW (DeepSpeed's Adam is AdamW unless adam_w_mode=false)"),
    ("optimizer.params.lr", "optim.lr", "peak learning rate"),
    ("optimizer.params.betas", "optim.betas", ""),
    ("optimizer.params.eps", "optim.eps", ""),
    ("optimizer.params.weight_decay", "optim.weight_decay", "decoupled (AdamW)"),
    ("scheduler.type=WarmupLR", "optim.schedule=constant", "warm-up, then constant"),
    ("scheduler.type=WarmupDecayLR", "optim.schedule=linear", "warm-up, then linear decay to 0 at total_num_steps"),
    ("scheduler.type=WarmupCosineLR", "optim.schedule=cosine", "warm-up, then cosine to cos_min_ratio"),
    ("scheduler.params.warmup_num_steps", "optim.warmup_steps", "linear warm-up here (DeepSpeed's default is log)"),
    ("scheduler.params.warmup_max_lr", "optim.lr", "WarmupLR/WarmupDecayLR"),
    ("scheduler.params.total_num_steps", "train.steps", "the schedule's length"),
    ("scheduler.params.cos_min_ratio", "optim.min_lr_ratio", "WarmupCosineLR"),
    ("wall_clock_breakdown", "(always on)", "step time and throughput are logged every train.log_every steps"),
    ("tensorboard.enabled", "metrics.tensorboard", ""),
]

# Keys FSDP2 handles differently or makes unnecessary: what fsdp-zero does instead.
NO_EFFECT = {
    "overlap_comm": "FSDP2 overlaps all-gathers and reduce-scatters with compute on its own streams",
    "contiguous_gradients": "FSDP2 reduce-scatters each unit's gradients from one flat buffer",
    "reduce_bucket_size": "FSDP2 reduces one unit (wrap plan) at a time; the units are the buckets",
    "allgather_bucket_size": "FSDP2 all-gathers one unit at a time; the units are the buckets",
    "allgather_partitions": "FSDP2 always all-gathers a unit's shards as one collective",
    "reduce_scatter": "FSDP2 always reduce-scatters gradients",
    "round_robin_gradients": "no effect with FSDP2",
    "sub_group_size": "FSDP2 steps each rank's optimizer on its shards as a whole",
    "stage3_prefetch_bucket_size": "FSDP2 prefetches the next unit; explicit depth: parallel.prefetch",
    "stage3_param_persistence_threshold": "every unit is sharded; small units: parallel.wrap.min_params",
    "stage3_max_live_parameters": "at most the gathered units of the current and the prefetched ones live",
    "stage3_max_reuse_distance": "FSDP2 frees a unit's gathered parameters after its forward (ZeRO-3) or backward",
    "stage3_gather_16bit_weights_on_model_save": "scripts/export.py writes full weights (safetensors) from a sharded checkpoint",
    "gather_16bit_weights_on_model_save": "scripts/export.py writes full weights (safetensors) from a sharded checkpoint",
    "elastic_checkpoint": "DCP checkpoints load at any world size",
    "ignore_unused_parameters": "FSDP2 handles parameters without gradients",
    "load_from_fp32_weights": "checkpoints hold the fp32 master weights",
    "memory_efficient_linear": "no effect with FSDP2",
    "offload_optimizer.pin_memory": "pinned on CUDA, unpinned on CPU-only runs",
    "offload_param.pin_memory": "pinned on CUDA, unpinned on CPU-only runs",
    "offload_optimizer.buffer_count": "no effect with FSDP2's CPU offload",
    "offload_optimizer.fast_init": "no effect with FSDP2's CPU offload",
    "offload_param.buffer_count": "no effect with FSDP2's CPU offload",
    "offload_param.buffer_size": "no effect with FSDP2's CPU offload",
    "offload_param.max_in_cpu": "no effect with FSDP2's CPU offload",
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
                                "parallel.activation_checkpointing=full|selective",
    "tensorboard.output_path": "TensorBoard events go to <run dir>/tb (run.root, run.name)",
    "tensorboard.job_name": "TensorBoard events go to <run dir>/tb (run.root, run.name)",
    "scheduler.params.warmup_min_lr": "warm-up starts at lr / warmup_steps",
    "scheduler.params.warmup_type": "the warm-up is linear",
    "scheduler.params.warmup_min_ratio": "warm-up starts at lr / warmup_steps",
    "scheduler.params.last_batch_iteration": "the learning rate is set from the step number on resume",
    "optimizer.params.torch_adam": "torch's AdamW",
    "optimizer.params.adam_w_mode": "AdamW (decoupled weight decay)",
    "optimizer.params.amsgrad": "AdamW without amsgrad",
    "dump_state": "the resolved config is printed and saved as config.yaml",
}
# Keys whose values we cannot honour, with the valid choices.
UNSUPPORTED = {
    "zero_quantized_weights": "ZeRO++ quantized weights: not supported (valid: false)",
    "zero_quantized_gradients": "ZeRO++ quantized gradients: not supported (valid: false)",
    "zero_quantized_nontrainable_weights": "not supported (valid: false)",
    "amp": "apex AMP: not supported; use fp16 or bf16",
    "pipeline": "pipeline parallelism: not supported",
    "sparse_attention": "not supported",
    "aio": "NVMe offload: not supported",
    "compression_training": "not supported",
    "elasticity": "DeepSpeed elasticity: not supported (see torchrun --max-restarts)",
    "autotuning": "not supported",
    "data_efficiency": "not supported",
    "curriculum_learning": "not supported",
}
SCHEDULES = {"WarmupLR": "constant", "WarmupDecayLR": "linear", "WarmupCosineLR": "cosine"}
SECTIONS = ("zero_optimization", "fp16", "bf16", "optimizer", "scheduler", "tensorboard")


def _is_auto(value: Any) -> bool:
    return isinstance(value, str) and value.lower() == "auto"


def _flatten(node: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in node.items():
        full = f"{prefix}{key}"
        if isinstance(value, dict) and full not in UNSUPPORTED and full not in NO_EFFECT:
            out |= _flatten(value, f"{full}.")
        else:
            out[full] = value
    return out


def _tail(key: str) -> str:
    """A zero_optimization key without its section (the tables list those by their own name)."""
    return key.split(".", 1)[-1] if key.startswith("zero_optimization.") else key


_MAPPED_KEYS = {k.split("=")[0] for k, _, _ in MAPPED}


def _known(key: str) -> bool:
    return key in _MAPPED_KEYS or any(k in NO_EFFECT or k in UNSUPPORTED for k in (key, _tail(key)))


def read_deepspeed(path: str | Path, world_size: int) -> tuple[list[str], list[str]]:
    """The overrides a DeepSpeed config stands for, and one note per key without effect or left to us.

    Raises:
        ValueError: a missing or malformed file, an unknown key, an unsupported value, or a contradiction;
            the message names the key (as ``ds_config <key>``) and the valid choices.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--deepspeed: file not found: {str(path)!r}")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"--deepspeed {str(path)!r}: not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"--deepspeed {str(path)!r}: must hold a JSON object of DeepSpeed keys")
    flat = _flatten(raw)
    out: list[str] = []
    notes: list[str] = []

    def bad(key: str, why: str) -> ValueError:
        return ValueError(f"ds_config {key}={flat.get(key)!r}: {why}")

    for key, value in flat.items():
        if not _known(key):
            section = key.split(".")[0]
            hint = f"; keys of '{section}' read here: " + ", ".join(
                k for k, _, _ in MAPPED if k.startswith(section + ".")) if section in SECTIONS else ""
            raise bad(key, f"unknown DeepSpeed key{hint}")
        tail = _tail(key)
        if key in UNSUPPORTED or tail in UNSUPPORTED:
            if value in (False, None, 0) or (isinstance(value, dict) and not value.get("enabled", True)):
                continue
            raise bad(key, UNSUPPORTED.get(key) or UNSUPPORTED[tail])
        if key in NO_EFFECT or tail in NO_EFFECT:
            notes.append(f"ds_config {key}={json.dumps(value)}: no effect; {NO_EFFECT.get(key) or NO_EFFECT[tail]}")
        elif _is_auto(value):
            notes.append(f"ds_config {key}=auto: fsdp-zero's value is used")

    def get(key: str) -> Any:
        value = flat.get(key)
        return None if _is_auto(value) else value

    def number(key: str, kind: type = float, minimum: float | None = None) -> Any:
        value = get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
            raise bad(key, f"expected {'an integer' if kind is int else 'a number'}")
        if minimum is not None and value < minimum:
            raise bad(key, f"must be >= {minimum}")
        return kind(value)

    # Batch: DeepSpeed's rule, train_batch_size = micro x accumulation x ranks.
    tbs, micro, gas = (number(k, int, 1) for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                                   "gradient_accumulation_steps"))
    if tbs is not None and micro is not None and gas is not None and tbs != micro * gas * world_size:
        raise bad("train_batch_size", f"!= train_micro_batch_size_per_gpu {micro} x gradient_accumulation_steps {gas} "
                  f"x {world_size} ranks = {micro * gas * world_size}")
    if tbs is None and micro is not None:
        tbs = micro * (gas or 1) * world_size
    if micro is None and tbs is not None:
        per = (gas or 1) * world_size
        if tbs % per:
            raise bad("train_batch_size", f"does not divide over gradient_accumulation_steps {gas or 1} x {world_size} ranks")
        micro = tbs // per
    if tbs is not None:
        out += [f"train.global_batch_size={tbs}", f"train.micro_batch_size={micro}"]
    for key, ours in (("gradient_clipping", "optim.grad_clip"), ("steps_per_print", "train.log_every")):
        value = number(key, float if key == "gradient_clipping" else int, 0)
        if value is not None:
            out.append(f"{ours}={value}")

    # ZeRO stage and offload.
    stage = get("zero_optimization.stage")
    if stage is not None:
        if stage not in (0, 1, 2, 3):
            raise bad("zero_optimization.stage", "valid choices: 0, 1, 2, 3")
        out.append(f"parallel.zero_stage={stage}")
    offload = []
    for part in ("offload_optimizer", "offload_param"):
        key = f"zero_optimization.{part}.device"
        device = get(key)
        if device is None or str(device).lower() == "none":
            continue
        if device != "cpu":
            raise bad(key, "valid choices: cpu, none (NVMe offload is not supported)")
        offload.append(part)
    if offload:
        if stage in (0, 1):
            raise bad(f"zero_optimization.{offload[0]}.device", f"offload needs ZeRO stage 2 or 3 here (FSDP2); "
                      f"zero_optimization.stage={stage}")
        if offload == ["offload_optimizer"]:
            notes.append("ds_config zero_optimization.offload_optimizer: FSDP2's CPU offload moves the parameter "
                         "shards to host memory too (as offload_param would)")
        out.append("parallel.cpu_offload=true")
    hpz = number("zero_optimization.zero_hpz_partition_size", int, 1)
    if hpz is not None and hpz > 1:
        out.append(f"parallel.reshard_after_forward={hpz}")
    mics = number("zero_optimization.mics_shard_size", int)
    if mics is not None and mics > 0:
        out += ["parallel.strategy=hybrid_shard", f"parallel.shard_size={mics}"]
        out = [o for o in out if not o.startswith("parallel.zero_stage=")]

    # Precision.
    fp16, bf16 = bool(get("fp16.enabled")), bool(get("bf16.enabled"))
    if fp16 and bf16:
        raise bad("fp16.enabled", "fp16 and bf16 are both enabled; enable one")
    if fp16 or bf16:
        out.append(f"precision.mode={'fp16' if fp16 else 'bf16'}-mixed")
    for key, ours, kind in (("fp16.loss_scale", "precision.loss_scale", float),
                            ("fp16.initial_scale_power", "precision.initial_scale_power", int),
                            ("fp16.loss_scale_window", "precision.loss_scale_window", int)):
        value = number(key, kind, 0)
        if value is not None and fp16:
            out.append(f"{ours}={value}")
    comm = get("communication_data_type")
    if comm is not None:
        dtypes = {"fp32": "fp32", "fp16": "fp16", "bf16": "bf16", "float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}
        if str(comm).lower() not in dtypes:
            raise bad("communication_data_type", f"valid choices: {', '.join(dtypes)}")
        out.append(f"precision.reduce_dtype={dtypes[str(comm).lower()]}")

    # Optimizer.
    kind = get("optimizer.type")
    if kind is not None:
        if str(kind).lower() not in ("adam", "adamw"):
            raise bad("optimizer.type", "valid choices: Adam, AdamW (fsdp-zero trains with AdamW)")
        if str(kind).lower() == "adam" and get("optimizer.params.adam_w_mode") is False:
            raise bad("optimizer.params.adam_w_mode", "Adam with L2 regularisation is not supported; valid: true (AdamW)")
    lr = number("optimizer.params.lr", float, 0)
    for key, ours in (("optimizer.params.eps", "optim.eps"), ("optimizer.params.weight_decay", "optim.weight_decay")):
        value = number(key, float, 0)
        if value is not None:
            out.append(f"{ours}={value}")
    betas = get("optimizer.params.betas")
    if betas is not None:
        if not (isinstance(betas, list) and len(betas) == 2 and all(isinstance(b, (int, float)) for b in betas)):
            raise bad("optimizer.params.betas", "expected two numbers, e.g. [0.9, 0.999]")
        out.append(f"optim.betas=[{betas[0]},{betas[1]}]")

    # Scheduler.
    sched = get("scheduler.type")
    if sched is not None:
        if sched not in SCHEDULES:
            raise bad("scheduler.type", f"valid choices: {', '.join(SCHEDULES)}")
        out.append(f"optim.schedule={SCHEDULES[sched]}")
        peak = number("scheduler.params.warmup_max_lr", float, 0)
        if peak is not None and sched != "WarmupCosineLR":
            lr = peak
        warmup = number("scheduler.params.warmup_num_steps", int, 0)
        if warmup is not None:
            out.append(f"optim.warmup_steps={warmup}")
        total = number("scheduler.params.total_num_steps", int, 1)
        if total is not None:
            out.append(f"train.steps={total}")
        floor = number("scheduler.params.cos_min_ratio", float, 0)
        out.append(f"optim.min_lr_ratio={floor if floor is not None else 1.0 if sched == 'WarmupLR' else 0.0}")
    if lr is not None:
        out.append(f"optim.lr={lr}")
    if get("wall_clock_breakdown"):
        notes.append("ds_config wall_clock_breakdown=true: step time and tokens/s are always logged (every "
                     "train.log_every steps); the memory breakdown at memory.profile_step")
    tb = get("tensorboard.enabled")
    if tb is not None:
        out.append(f"metrics.tensorboard={str(bool(tb)).lower()}")
    return out, notes


def mapping_table() -> str:
    """The README's table: each DeepSpeed key and ours, then the keys without effect."""
    rows = ["| DeepSpeed key | fsdp-zero | meaning |", "|---|---|---|"]
    rows += [f"| `{ds}` | `{ours}` | {what} |" for ds, ours, what in MAPPED]
    rows += [f"| `{ds}` | no effect | {why} |" for ds, why in NO_EFFECT.items()]
    rows += [f"| `{ds}` | error unless off | {why} |" for ds, why in UNSUPPORTED.items()]
    return "\n".join(rows)
