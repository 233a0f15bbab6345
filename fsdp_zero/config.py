"""The typed configuration schema: dataclasses, YAML deltas and dotlist overrides.

A run's config is the dataclass defaults below, merged with an optional YAML file
that holds only the keys it changes, merged with ``key=value`` overrides from the
command line. Every user mistake (an unknown key, a value of the wrong type, a bad
choice, a batch that does not divide) is a ``ValueError`` naming the key, the bad
value and what would be valid, raised before anything is built or written.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from fsdp_zero.torch_private import config_value


class WrapPolicy(str, enum.Enum):
    """Which submodules become FSDP units (each unit all-gathers its parameters as one)."""

    transformer = "transformer"  # modules whose class name is in `classes`
    size_based = "size_based"  # modules holding >= `min_params` not already wrapped
    modules = "modules"  # modules whose FQN matches one of the regexes in `modules`
    none = "none"  # only the root: the whole model is one unit


class Strategy(str, enum.Enum):
    """How model state is partitioned across data-parallel ranks.

    full_shard (ZeRO-3): parameters, gradients and optimizer state sharded; each unit's
        parameters are all-gathered for forward, freed, and all-gathered again for
        backward (``reshard_after_forward=True``). Least memory, one extra all-gather.
    shard_grad_op (ZeRO-2): as full_shard, but parameters stay gathered from forward
        to backward (``reshard_after_forward=False``). Less communication, the full
        parameters of every unit are held between forward and backward.
    hybrid_shard (HSDP): full_shard within groups of ``parallel.shard_size`` ranks,
        replicated across groups (a 2-D mesh): all-gathers stay inside a group (a node),
        at the price of 16 P / shard_size instead of 16 P / N.
    zero1 (ZeRO-1): DDP with torch's ZeroRedundancyOptimizer: only the optimizer states
        are sharded (by whole parameters); every rank holds all parameters and gradients.
    ddp: plain DistributedDataParallel, the baseline: 16 P on every rank.
    """

    full_shard = "full_shard"
    shard_grad_op = "shard_grad_op"
    hybrid_shard = "hybrid_shard"
    zero1 = "zero1"
    ddp = "ddp"


# The names users bring from FSDP1 and DeepSpeed.
STRATEGY_ALIASES = {"FULL_SHARD": "full_shard", "SHARD_GRAD_OP": "shard_grad_op", "HYBRID_SHARD": "hybrid_shard",
                    "NO_SHARD": "ddp"}
ZERO_STAGES = {0: Strategy.ddp, 1: Strategy.zero1, 2: Strategy.shard_grad_op, 3: Strategy.full_shard}


class DataSource(str, enum.Enum):
    synthetic = "synthetic"  # a seeded random bigram process: learnable, no files needed
    text = "text"  # a local file or folder read as byte-level tokens (vocab 256)
    tokens = "tokens"  # a pre-tokenized file of token ids (.bin as nanoGPT writes it, or .npy), memory-mapped
    images = "images"  # a torchvision ImageFolder directory (class per sub-folder), for classification
    fake_images = "fake_images"  # torchvision's FakeData: random images and labels, for tests and demos


class Task(str, enum.Enum):
    """What a batch is and how the loss is computed from it (see fsdp_zero.tasks)."""

    causal_lm = "causal_lm"  # tokens in, next-token cross-entropy
    classification = "classification"  # images (or features) and labels in, cross-entropy; accuracy logged
    custom = "custom"  # model.loss(model, batch) returns the loss


class Init(str, enum.Enum):
    """How a model's parameters get their initial values after materialisation (see fsdp_zero.init)."""

    auto = "auto"  # the model's own init_weights(seed) if it has one, else standard
    standard = "standard"  # each standard layer's reset_parameters distribution, identical at any world size
    model = "model"  # the model's own initialiser (init_weights(seed), or Hugging Face's _init_weights)


class Backend(str, enum.Enum):
    auto = "auto"  # nccl on CUDA, gloo on CPU
    gloo = "gloo"
    nccl = "nccl"


class Device(str, enum.Enum):
    auto = "auto"  # cuda when a GPU is visible, else cpu
    cpu = "cpu"
    cuda = "cuda"


class ActivationCheckpointing(str, enum.Enum):
    """Which units recompute their activations in backward instead of keeping them (see fsdp_zero.parallelize)."""

    none = "none"
    full = "full"  # every block unit of the wrap plan
    selective = "selective"  # every k-th block unit (parallel.activation_checkpointing_every)


class Schedule(str, enum.Enum):
    """The learning rate after the linear warm-up, towards ``min_lr_ratio * lr`` at the last step."""

    cosine = "cosine"  # half a cosine period (DeepSpeed's WarmupCosineLR)
    linear = "linear"  # a straight line (DeepSpeed's WarmupDecayLR)
    constant = "constant"  # stays at lr (DeepSpeed's WarmupLR)


class OptimizerImpl(str, enum.Enum):
    auto = "auto"  # fused on CUDA, foreach on CPU
    fused = "fused"
    foreach = "foreach"
    for_loop = "for_loop"


@dataclass
class ModelConfig:
    """The built-in decoder-only transformer (``preset`` and its fields; ``None`` fields take the
    preset's value), or any model: ``target`` names a class or factory, called with ``kwargs``."""

    preset: str = "gpt_tiny"
    # package.module:callable returning an nn.Module, e.g. torchvision.models:VisionTransformer or
    # transformers:LlamaForCausalLM (a Hugging Face class is given its config built from kwargs).
    target: str | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)
    task: Task = Task.causal_lm
    loss: str | None = None  # task=custom: package.module:function(model, batch) -> loss
    init: Init = Init.auto
    vocab_size: int | None = None
    dim: int | None = None
    n_layers: int | None = None
    n_heads: int | None = None
    n_kv_heads: int | None = None
    ffn_hidden_dim: int | None = None
    max_seq_len: int | None = None
    tie_embeddings: bool | None = None
    # A standard, non-sharded state dict to start from: a torch.save(model.state_dict())
    # .pt file, a .safetensors file, or a folder of safetensors shards with an index.
    init_from: str | None = None


@dataclass
class DataConfig:
    source: DataSource = DataSource.synthetic
    path: str | None = None  # file or folder, for source=text
    seq_len: int = 128
    # tokens: the dtype of a .bin file (a .npy file carries its own).
    token_dtype: str = "uint16"
    # images / fake_images: square side in pixels after resizing and cropping.
    image_size: int = 32
    num_classes: int = 10  # fake_images: how many label values FakeData draws
    num_samples: int = 1000  # fake_images: how many distinct images before they repeat
    # DataLoader worker processes per rank; None: 2 for images (decoding), 0 otherwise.
    num_workers: int | None = None
    # synthetic: each token is followed by one of `branching` successors (skewed odds),
    # so the loss falls from ln(vocab) towards ~ln(branching).
    branching: int = 4


@dataclass
class WrapConfig:
    policy: WrapPolicy = WrapPolicy.transformer
    classes: list[str] = field(default_factory=list)  # empty: the model's block class
    min_params: int = 1_000_000
    modules: list[str] = field(default_factory=list)  # FQN regexes (re.fullmatch)


@dataclass
class ParallelConfig:
    strategy: Strategy = Strategy.full_shard
    # DeepSpeed's name for the same choice: 0 ddp, 1 zero1, 2 shard_grad_op, 3 full_shard.
    zero_stage: int | None = None
    shard_size: int = 2  # hybrid_shard: ranks per sharding group (usually the GPUs of a node)
    wrap: WrapConfig = field(default_factory=WrapConfig)
    # Explicit prefetch: each unit starts the all-gather of the next `prefetch` units (forward), and
    # of the previous ones (backward), before it computes. 0: FSDP2's own scheduling.
    prefetch: int = 0
    # full_shard only: after forward, keep each unit's parameters sharded over groups of this many
    # ranks instead of all of them (ZeRO++'s hierarchical partitioning, hpZ): backward all-gathers
    # stay within a group (a node), at 16 P / N + 4 P / reshard_after_forward bytes. None: over all.
    reshard_after_forward: int | None = None
    # FSDP strategies: sharded parameters, gradients and optimizer states live in host memory and the
    # optimizer steps on the CPU (DeepSpeed's offload_param + offload_optimizer to cpu); each unit is
    # copied to the device for its forward and backward.
    cpu_offload: bool = False
    # Recompute activations in backward: none, full (every block of the wrap plan), or selective
    # (every k-th block, k = activation_checkpointing_every). Applied before compiling and sharding.
    activation_checkpointing: ActivationCheckpointing = ActivationCheckpointing.none
    activation_checkpointing_every: int = 2


# precision.mode: how model state is stored, computed and reduced (see fsdp_zero.precision).
PRECISION_MODES = ("fp32", "bf16-mixed", "fp16-mixed", "bf16-true")
PRECISION_DTYPES = ("fp32", "bf16", "fp16")


@dataclass
class PrecisionConfig:
    """``precision=bf16-mixed`` is short for ``precision.mode=bf16-mixed``.

    fp32: everything fp32. bf16-mixed / fp16-mixed: fp32 sharded master weights, gradients and
    AdamW states; each unit's parameters gathered in bf16/fp16 for forward and backward; gradients
    reduced in fp32. bf16-true: parameters, gradients and AdamW states all bf16 (half the memory,
    and the precision to match). fp16 gradients are loss-scaled (a dynamic scale, as DeepSpeed's).
    """

    mode: str = "fp32"
    param_dtype: str | None = None  # the gathered (compute) dtype; None: the mode's
    reduce_dtype: str | None = None  # the gradient reduction dtype; None: fp32 (bf16 for bf16-true)
    # fp16 loss scaling: 0 = dynamic, starting at 2**initial_scale_power, doubled after
    # loss_scale_window steps without overflow, halved (and the step skipped) on an overflow;
    # > 0 = a fixed scale (overflowing steps are still skipped).
    loss_scale: float = 0.0
    initial_scale_power: int = 16
    loss_scale_window: int = 1000


@dataclass
class OptimConfig:
    """AdamW with linear warm-up, then a cosine (or linear, or no) decay to ``min_lr_ratio * lr``."""

    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    schedule: Schedule = Schedule.cosine
    weight_decay: float = 0.1
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    grad_clip: float = 1.0  # max global L2 norm of the gradients; 0 disables clipping
    implementation: OptimizerImpl = OptimizerImpl.auto


@dataclass
class TrainConfig:
    steps: int = 150
    global_batch_size: int = 16  # sequences per optimizer step, over all ranks
    micro_batch_size: int = 4  # sequences per forward/backward on one rank
    log_every: int = 10
    # Stop this invocation after this step (saving a checkpoint) while the LR schedule
    # still spans train.steps: for jobs cut into pieces by a time limit. None: train.steps.
    stop_after: int | None = None
    seed: int | None = 1234  # None: rank 0 draws one and broadcasts it
    # torch.compile each block unit (after activation checkpointing, before sharding); off by default.
    compile: bool = False
    # A time budget: after this many minutes of training the run saves a checkpoint and stops (exit
    # code 4, as on SIGTERM), before a scheduler's wall-clock limit; leave a save's time of margin.
    max_minutes: float | None = None
    # Non-finite steps (a NaN or inf loss on any rank, or gradient norm) to skip over the whole run
    # before stopping as diverged (exit code 3); a skipped step leaves weights and AdamW states as
    # they were. 0: stop at the first. Counted in TensorBoard (train/skipped_nonfinite).
    skip_nonfinite: int = 0


@dataclass
class CheckpointConfig:
    """Sharded DCP checkpoints under <run dir>/checkpoints/step-NNNNNNN/."""

    enabled: bool = True
    every: int = 50  # steps between saves (and always one at the end); 0: only at the end
    keep_last: int = 2  # of the checkpoints this launch saves, the newest kept (0: all); others' are never deleted
    # auto: continue from the newest complete checkpoint in the run directory, if any;
    # none: start fresh (refused if the run directory already holds checkpoints);
    # anything else: the path of a checkpoint folder to continue from.
    resume: str = "auto"
    async_save: bool = False  # write in a background thread while training goes on


@dataclass
class RunConfig:
    root: str = "runs"
    name: str | None = None  # None: a timestamp; the run directory is root/name


@dataclass
class DistConfig:
    backend: Backend = Backend.auto
    device: Device = Device.auto
    # How long a collective may wait for the other ranks before this rank gives up with one line
    # naming its step and the collective it was in (a rank that died or hangs): timeout_minutes
    # during start-up (building, loading a checkpoint) and checkpoint saves, which wait for the
    # slowest rank's I/O; step_timeout_minutes from the end of the first step on.
    timeout_minutes: float = 30.0
    step_timeout_minutes: float = 5.0


@dataclass
class MetricsConfig:
    tensorboard: bool = True


@dataclass
class MemoryConfig:
    # glibc only: allocations of at least this many bytes get their own mmap and go back to
    # the system when freed (see fsdp_zero.memory.set_malloc_mmap_threshold). "auto": 8 MiB on
    # CPU runs, glibc's default on CUDA runs (tensors live in CUDA memory there); "default":
    # glibc's default; or a byte count.
    malloc_mmap_threshold: str = "auto"
    # The step whose memory is broken down by category (params, gathered params, grads,
    # optimizer, activations, comm buffers) with PyTorch's MemTracker; 0: none. One step
    # only: the tracker intercepts every op and is slow.
    profile_step: int = 2


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    run: RunConfig = field(default_factory=RunConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)


# ---------------------------------------------------------------------------------
# Loading


def load_config(config_path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """Defaults, then the YAML file's deltas, then ``key=value`` overrides.

    Raises:
        ValueError: a missing file, an unknown key, a wrong type or a bad choice; the
            message names the key, the value and the valid choices.
    """
    layers: list[tuple[str, DictConfig]] = []
    if config_path is not None:
        path = Path(config_path)
        if not path.is_file():
            raise ValueError(f"--config: file not found: {str(path)!r}")
        try:
            loaded = OmegaConf.load(path)
        except Exception as e:  # yaml's errors carry the line and column
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            problem = getattr(e, "problem", None) or str(e).splitlines()[0]
            raise ValueError(f"--config {str(path)!r}: not valid YAML{where}: {problem}") from None
        if not isinstance(loaded, DictConfig):
            raise ValueError(f"--config {str(path)!r}: must hold a mapping of keys, got {type(loaded).__name__}")
        layers.append((str(path), loaded))
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ValueError(f"override {item!r}: expected key=value, e.g. train.steps=50")
        try:
            layers.append((f"override {item!r}", OmegaConf.from_dotlist([item])))
        except Exception as e:
            raise ValueError(f"override {item!r}: {e}") from None

    merged = OmegaConf.structured(Config)
    for origin, layer in layers:
        _apply_aliases(layer)
        _check_keys(layer, Config, prefix="", origin=origin)
        try:
            merged = OmegaConf.merge(merged, layer)
        except OmegaConfBaseException as e:
            raise ValueError(_explain(e, origin)) from None
    try:
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:  # e.g. a ${...} interpolation that does not resolve
        raise ValueError(_explain(e, "config")) from None
    assert isinstance(cfg, Config)
    validate(cfg)
    return cfg


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def _apply_aliases(layer: DictConfig) -> None:
    """``precision=MODE`` to ``precision.mode=MODE``; FSDP1 strategy names (FULL_SHARD, NO_SHARD, ...) to
    ours; DeepSpeed's zero_stage to a strategy."""
    if "precision" in layer and isinstance(config_value(layer, "precision"), str):
        layer.precision = {"mode": config_value(layer, "precision")}
    parallel = layer.get("parallel") if isinstance(layer.get("parallel", None), DictConfig) else None
    if parallel is None:
        return
    strategy = parallel.get("strategy", None)
    if isinstance(strategy, str) and strategy.upper() in STRATEGY_ALIASES:
        parallel.strategy = STRATEGY_ALIASES[strategy.upper()]
    stage = parallel.get("zero_stage", None)
    if stage is not None:
        if stage not in ZERO_STAGES:
            raise ValueError(f"parallel.zero_stage={stage!r} is not a valid choice; valid choices: 0, 1, 2, 3")
        mapped = ZERO_STAGES[stage].value
        if strategy is not None and parallel.strategy != mapped:
            raise ValueError(f"parallel.zero_stage={stage} means parallel.strategy={mapped}, but "
                             f"parallel.strategy={strategy} is also set; set one of them")
        parallel.strategy = mapped


def _check_keys(node: DictConfig, schema: type, prefix: str, origin: str) -> None:
    """Unknown keys are errors that suggest the closest known key."""
    fields = {f.name: f for f in dataclasses.fields(schema)}
    for key in node.keys():
        full = f"{prefix}{key}"
        if key not in fields:
            close = difflib.get_close_matches(str(key), fields, n=1)
            hint = f"; did you mean '{prefix}{close[0]}'?" if close else ""
            valid = ", ".join(f"{prefix}{k}" for k in fields)
            raise ValueError(f"{origin}: unknown config key '{full}'{hint} (valid keys here: {valid})")
        ftype = _field_type(schema, key)
        if dataclasses.is_dataclass(ftype):
            value = node[key]
            if not isinstance(value, DictConfig):
                raise ValueError(f"{origin}: '{full}' is a section; set its keys, e.g. {full}.<key>=...")
            _check_keys(value, ftype, prefix=f"{full}.", origin=origin)
        elif isinstance(ftype, type) and issubclass(ftype, enum.Enum):
            raw = config_value(node, key)
            if isinstance(raw, str) and raw not in ftype.__members__:
                choices = ", ".join(ftype.__members__)
                raise ValueError(f"{origin}: {full}={raw!r} is not a valid choice; valid choices: {choices}")


def _field_type(schema: type, name: str) -> Any:
    hints = typing.get_type_hints(schema)
    ftype = hints[name]
    args = [a for a in typing.get_args(ftype) if a is not type(None)]
    if typing.get_origin(ftype) in (typing.Union, types.UnionType) and len(args) == 1:
        return args[0]
    return ftype


def _explain(e: OmegaConfBaseException, origin: str) -> str:
    key = getattr(e, "full_key", None) or "?"
    msg = str(e).split("\n")[0]
    return f"{origin}: bad value for '{key}': {msg}"


# ---------------------------------------------------------------------------------
# Semantic checks that do not depend on the world size (see `batch_layout` for those)


def validate(cfg: Config) -> None:
    from fsdp_zero.model import PRESETS  # the presets live with the model

    def positive(key: str, value: int | float | None) -> None:
        if value is not None and value <= 0:
            raise ValueError(f"{key}={value}: must be > 0")

    m = cfg.model
    if m.target is None:
        if m.preset not in PRESETS:
            close = difflib.get_close_matches(m.preset, PRESETS, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise ValueError(f"model.preset={m.preset!r} is unknown{hint}; valid choices: {', '.join(PRESETS)}")
        if m.kwargs:
            raise ValueError(f"model.kwargs={dict(m.kwargs)} is set without model.target; the built-in model takes "
                             f"model.{', model.'.join(BUILTIN_FIELDS)}")
    else:
        if not _is_target(m.target):
            raise ValueError(f"model.target={m.target!r}: expected package.module:callable, e.g. "
                             "torchvision.models:VisionTransformer")
        builtin = [f"model.{k}={getattr(m, k)!r}" for k in BUILTIN_FIELDS if getattr(m, k) is not None]
        if builtin:
            raise ValueError(f"{', '.join(builtin)} only applies to the built-in model, not to model.target={m.target}; "
                             "pass the model's own arguments in model.kwargs")
    if m.task is Task.custom and m.loss is None:
        raise ValueError("model.task=custom needs model.loss: package.module:function taking (model, batch), returning the loss")
    if m.loss is not None:
        if m.task is not Task.custom:
            raise ValueError(f"model.loss={m.loss!r} is set but model.task={m.task.value}; set model.task=custom to use it")
        if not _is_target(m.loss):
            raise ValueError(f"model.loss={m.loss!r}: expected package.module:function")
    for name in BUILTIN_FIELDS:
        if name != "tie_embeddings":
            positive(f"model.{name}", getattr(m, name))
    for key, value in [
        ("data.seq_len", cfg.data.seq_len),
        ("data.branching", cfg.data.branching),
        ("data.image_size", cfg.data.image_size),
        ("data.num_classes", cfg.data.num_classes),
        ("data.num_samples", cfg.data.num_samples),
        ("train.steps", cfg.train.steps),
        ("train.global_batch_size", cfg.train.global_batch_size),
        ("train.micro_batch_size", cfg.train.micro_batch_size),
        ("train.log_every", cfg.train.log_every),
        ("train.stop_after", cfg.train.stop_after),
        ("train.max_minutes", cfg.train.max_minutes),
        ("dist.timeout_minutes", cfg.dist.timeout_minutes),
        ("dist.step_timeout_minutes", cfg.dist.step_timeout_minutes),
        ("optim.lr", cfg.optim.lr),
        ("parallel.wrap.min_params", cfg.parallel.wrap.min_params),
        ("parallel.reshard_after_forward", cfg.parallel.reshard_after_forward),
        ("parallel.activation_checkpointing_every", cfg.parallel.activation_checkpointing_every),
        ("precision.loss_scale_window", cfg.precision.loss_scale_window),
    ]:
        positive(key, value)
    threshold = cfg.memory.malloc_mmap_threshold
    if threshold not in ("auto", "default") and not (threshold.isdigit() and int(threshold) > 0):
        raise ValueError(f"memory.malloc_mmap_threshold={threshold!r}: valid choices: auto, default, or a byte count > 0")
    if cfg.parallel.prefetch < 0:
        raise ValueError(f"parallel.prefetch={cfg.parallel.prefetch}: must be >= 0 (0: FSDP2's own scheduling)")
    if cfg.parallel.reshard_after_forward is not None and cfg.parallel.strategy is not Strategy.full_shard:
        raise ValueError(f"parallel.reshard_after_forward={cfg.parallel.reshard_after_forward} applies to "
                         f"parallel.strategy=full_shard only, not {cfg.parallel.strategy.value}")
    if cfg.memory.profile_step < 0:
        raise ValueError(f"memory.profile_step={cfg.memory.profile_step}: must be >= 0 (0: no profiling)")
    if cfg.checkpoint.every < 0 or cfg.checkpoint.keep_last < 0:
        raise ValueError(
            f"checkpoint.every={cfg.checkpoint.every}, checkpoint.keep_last={cfg.checkpoint.keep_last}: must be >= 0 (0: "
            "only at the end / keep all)"
        )
    if cfg.checkpoint.resume not in ("auto", "none") and not Path(cfg.checkpoint.resume).is_dir():
        raise ValueError(
            f"checkpoint.resume={cfg.checkpoint.resume!r}: no such checkpoint folder; valid choices: auto, none, "
            "or the path of a checkpoint (…/checkpoints/step-NNNNNNN)"
        )
    if cfg.model.init_from is not None and not Path(cfg.model.init_from).exists():
        raise ValueError(f"model.init_from={cfg.model.init_from!r}: no such file or folder")
    if cfg.optim.warmup_steps < 0:
        raise ValueError(f"optim.warmup_steps={cfg.optim.warmup_steps}: must be >= 0")
    if cfg.optim.eps <= 0:
        raise ValueError(f"optim.eps={cfg.optim.eps}: must be > 0")
    if cfg.optim.weight_decay < 0:
        raise ValueError(f"optim.weight_decay={cfg.optim.weight_decay}: must be >= 0")
    for key in ("stop_after", "max_minutes"):
        if getattr(cfg.train, key) is not None and not cfg.checkpoint.enabled:
            raise ValueError(f"train.{key} needs checkpoint.enabled=true: a run stopped early continues from its checkpoint")
    if cfg.train.skip_nonfinite < 0:
        raise ValueError(f"train.skip_nonfinite={cfg.train.skip_nonfinite}: must be >= 0 (0: stop at the first "
                         "non-finite step)")
    if cfg.optim.grad_clip < 0:
        raise ValueError(f"optim.grad_clip={cfg.optim.grad_clip}: must be >= 0 (0 disables clipping)")
    if not 0 <= cfg.optim.min_lr_ratio <= 1:
        raise ValueError(f"optim.min_lr_ratio={cfg.optim.min_lr_ratio}: must be in [0, 1]")
    if len(cfg.optim.betas) != 2 or not all(0 <= b < 1 for b in cfg.optim.betas):
        raise ValueError(f"optim.betas={list(cfg.optim.betas)}: must be two numbers in [0, 1)")
    if cfg.train.global_batch_size % cfg.train.micro_batch_size:
        raise ValueError(
            f"train.global_batch_size={cfg.train.global_batch_size} is not a multiple of "
            f"train.micro_batch_size={cfg.train.micro_batch_size}"
        )
    _validate_data(cfg.data, m.task)
    _validate_precision(cfg.precision, cfg.parallel.strategy)
    if cfg.parallel.cpu_offload and cfg.parallel.strategy not in (Strategy.full_shard, Strategy.shard_grad_op,
                                                                   Strategy.hybrid_shard):
        raise ValueError(f"parallel.cpu_offload=true needs an FSDP strategy (full_shard, shard_grad_op, hybrid_shard), "
                         f"not parallel.strategy={cfg.parallel.strategy.value}")
    if cfg.parallel.zero_stage is not None and ZERO_STAGES.get(cfg.parallel.zero_stage) is not cfg.parallel.strategy:
        raise ValueError(f"parallel.zero_stage={cfg.parallel.zero_stage} contradicts "
                         f"parallel.strategy={cfg.parallel.strategy.value}; set one of them")
    if cfg.parallel.wrap.policy is WrapPolicy.modules and not cfg.parallel.wrap.modules:
        raise ValueError(
            "parallel.wrap.policy=modules needs parallel.wrap.modules, a list of FQN regexes, "
            "e.g. 'parallel.wrap.modules=[layers\\.\\d+]'"
        )
    if cfg.run.name is not None and ("/" in cfg.run.name or cfg.run.name in ("", ".", "..")):
        raise ValueError(f"run.name={cfg.run.name!r}: must be a plain folder name (set run.root for the parent)")


# The built-in transformer's own settings (the preset's fields).
BUILTIN_FIELDS = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden_dim", "max_seq_len",
                  "tie_embeddings")
TOKEN_SOURCES = (DataSource.synthetic, DataSource.text, DataSource.tokens)
TOKEN_DTYPES = ("uint16", "uint32", "int32", "int64")
# What each source needs in data.path, and which tasks it feeds (custom takes any).
_PATHS = {DataSource.text: "a text file or a folder of them", DataSource.tokens: "a .bin or .npy file of token ids",
          DataSource.images: "an ImageFolder directory, one sub-folder of images per class"}
_TASK_SOURCES = {Task.causal_lm: TOKEN_SOURCES,
                 Task.classification: (DataSource.images, DataSource.fake_images)}


def _is_target(text: str) -> bool:
    module, _, name = text.partition(":")
    return bool(module and name) and all(part.isidentifier() for part in module.split(".") + name.split("."))


def _validate_precision(p: PrecisionConfig, strategy: Strategy) -> None:
    if p.mode not in PRECISION_MODES:
        raise ValueError(f"precision.mode={p.mode!r} is not a valid choice; valid choices: {', '.join(PRECISION_MODES)}")
    for key in ("param_dtype", "reduce_dtype"):
        value = getattr(p, key)
        if value is not None and value not in PRECISION_DTYPES:
            raise ValueError(f"precision.{key}={value!r} is not a valid choice; valid choices: {', '.join(PRECISION_DTYPES)}")
    mixed = p.mode.endswith("-mixed") or p.param_dtype not in (None, "fp32") or p.reduce_dtype not in (None, "fp32")
    if mixed and p.mode != "bf16-true" and strategy in (Strategy.ddp, Strategy.zero1):
        raise ValueError(f"precision.mode={p.mode} (gathered parameters in a lower precision than the stored ones) needs "
                         f"an FSDP strategy (full_shard, shard_grad_op, hybrid_shard), not parallel.strategy="
                         f"{strategy.value}; with {strategy.value} use precision.mode=fp32 or bf16-true")
    if p.loss_scale < 0:
        raise ValueError(f"precision.loss_scale={p.loss_scale}: must be >= 0 (0: dynamic loss scaling)")


def _validate_data(d: DataConfig, task: Task) -> None:
    sources = _TASK_SOURCES.get(task)
    if sources and d.source not in sources:
        raise ValueError(f"data.source={d.source.value} does not feed model.task={task.value}; valid choices: "
                         f"{', '.join(s.value for s in sources)}")
    if d.source in _PATHS:
        if not d.path:
            raise ValueError(f"data.source={d.source.value} needs data.path ({_PATHS[d.source]})")
        path = Path(d.path)
        if not path.exists():
            raise ValueError(f"data.path={d.path!r}: no such file or folder")
        if d.source is DataSource.tokens and (not path.is_file() or path.suffix not in (".bin", ".npy")):
            raise ValueError(f"data.path={d.path!r}: data.source=tokens needs {_PATHS[d.source]}")
        if d.source is DataSource.images and not path.is_dir():
            raise ValueError(f"data.path={d.path!r}: data.source=images needs {_PATHS[d.source]}")
    elif d.path:
        valid = ", ".join(s.value for s in _PATHS)
        raise ValueError(f"data.path={d.path!r} is set but data.source={d.source.value} reads no files; "
                         f"data.source with a path: {valid}")
    if d.token_dtype not in TOKEN_DTYPES:
        raise ValueError(f"data.token_dtype={d.token_dtype!r} is not a valid choice; valid choices: {', '.join(TOKEN_DTYPES)}")
    if d.num_workers is not None and d.num_workers < 0:
        raise ValueError(f"data.num_workers={d.num_workers}: must be >= 0 (0: load in the training process)")


@dataclass(frozen=True)
class BatchLayout:
    """How one optimizer step's global batch splits over ranks and micro-batches."""

    global_batch_size: int
    micro_batch_size: int
    dp_size: int
    grad_accum_steps: int

    def describe(self, seq_len: int | None) -> str:
        """``seq_len``: tokens per sample, for token data (None: samples are not sequences)."""
        tokens = f" ({self.global_batch_size * seq_len:,} tokens per step)" if seq_len else ""
        return (
            f"global batch {self.global_batch_size} samples = micro-batch {self.micro_batch_size} "
            f"x grad-accum {self.grad_accum_steps} x data-parallel ranks {self.dp_size}{tokens}"
        )


def batch_layout(cfg: TrainConfig, dp_size: int) -> BatchLayout:
    """Derives the gradient-accumulation steps, as DeepSpeed does from train_batch_size.

    Raises:
        ValueError: the global batch does not split evenly over ``dp_size`` ranks.
    """
    per_step = cfg.micro_batch_size * dp_size
    if cfg.global_batch_size % per_step:
        valid = [m for m in range(1, cfg.global_batch_size + 1) if cfg.global_batch_size % (m * dp_size) == 0]
        hint = f"valid train.micro_batch_size values at {dp_size} ranks: {valid}" if valid else (
            f"train.global_batch_size must be a multiple of the {dp_size} ranks"
        )
        raise ValueError(
            f"train.global_batch_size={cfg.global_batch_size} does not divide into "
            f"train.micro_batch_size={cfg.micro_batch_size} x {dp_size} data-parallel ranks; {hint}"
        )
    return BatchLayout(cfg.global_batch_size, cfg.micro_batch_size, dp_size, cfg.global_batch_size // per_step)
