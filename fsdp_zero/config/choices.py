"""The closed sets a configuration key chooses from (enums: a YAML or command-line string is checked
against their values, `fsdp_zero.config.schema`)."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class WrapPolicy(str, enum.Enum):
    """Which submodules become FSDP units (each unit all-gathers its parameters as one)."""

    transformer = "transformer"  # modules whose class name is in `classes`
    size_based = "size_based"  # modules holding >= `min_params` not already wrapped
    modules = "modules"  # modules whose FQN matches one of the regexes in `modules`
    none = "none"  # only the root: the whole model is one unit


class DataSource(str, enum.Enum):
    synthetic = "synthetic"  # a seeded random bigram process: learnable, no files needed
    text = "text"  # a local file or folder read as byte-level tokens (vocab 256)
    # a pre-tokenized file of token ids (.bin as nanoGPT writes it, or .npy), memory-mapped
    tokens = "tokens"
    # a torchvision ImageFolder directory (class per sub-folder), for classification
    images = "images"
    # torchvision's FakeData: random images and labels, for tests and demos
    fake_images = "fake_images"


class Task(str, enum.Enum):
    """What a batch is and how the loss is computed from it (see fsdp_zero.model.tasks)."""

    causal_lm = "causal_lm"  # tokens in, next-token cross-entropy
    # images (or features) and labels in, cross-entropy; accuracy logged
    classification = "classification"
    custom = "custom"  # model.loss(model, batch) returns the loss


class Init(str, enum.Enum):
    """How a model's parameters get their initial values after materialisation (see fsdp_zero.model.init)."""

    auto = "auto"  # the model's own init_weights(seed) if it has one, else standard
    # each standard layer's reset_parameters distribution, identical at any world size
    standard = "standard"
    # the model's own initialiser (init_weights(seed), or Hugging Face's _init_weights)
    model = "model"


class Quantize(str, enum.Enum):
    """How LoRA's frozen base is stored (``model.lora.quantize``, docs/lora.md)."""

    none = "none"  # in the stored dtype, as every other parameter
    # QLoRA: 4-bit NormalFloat with double-quantized scalers, about 0.516 B per parameter (torchao)
    nf4 = "nf4"


class Backend(str, enum.Enum):
    auto = "auto"  # nccl on CUDA, gloo on CPU
    gloo = "gloo"
    nccl = "nccl"


class Device(str, enum.Enum):
    auto = "auto"  # cuda when a GPU is visible, else cpu
    cpu = "cpu"
    cuda = "cuda"


class ActivationCheckpointing(str, enum.Enum):
    """Which units recompute their activations in backward instead of keeping them (see
    fsdp_zero.sharding.parallelize)."""

    none = "none"
    full = "full"  # every block unit of the wrap plan
    selective = "selective"  # every k-th block unit (parallel.activation_checkpointing_every)


class Schedule(str, enum.Enum):
    """The learning rate after the linear warm-up, towards ``min_lr_ratio * lr`` at the last step."""

    cosine = "cosine"  # half a cosine period (DeepSpeed's WarmupCosineLR)
    linear = "linear"  # a straight line (DeepSpeed's WarmupDecayLR)
    constant = "constant"  # stays at lr (DeepSpeed's WarmupLR)


class Warmup(str, enum.Enum):
    """How the learning rate climbs, and from which step the schedule counts."""

    linear = "linear"  # step s of warmup_steps at (s + 1) / warmup_steps of lr
    # DeepSpeed's schedulers exactly (--deepspeed sets them): step s at the factor of step s - 1, the
    # first at warmup_start_ratio; a logarithmic or linear climb over max(2, warmup_steps) steps
    deepspeed_log = "deepspeed_log"
    deepspeed_linear = "deepspeed_linear"


class PrecisionMode(enum.StrEnum):
    """How model state is stored, computed and reduced (see fsdp_zero.sharding.precision)."""

    fp32 = "fp32"  # everything fp32
    # fp32 master weights, gradients and states; each unit gathered in bf16 (fp16) for compute
    bf16_mixed = "bf16-mixed"
    fp16_mixed = "fp16-mixed"
    bf16_true = "bf16-true"  # parameters, gradients and AdamW states all bf16


class DType(enum.StrEnum):
    """A floating-point dtype by its short name (precision.param_dtype, precision.reduce_dtype)."""

    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


class Float8Recipe(enum.StrEnum):
    """How float8 compute scales its values (torchao's recipes; docs/memory-levers.md)."""

    none = "none"  # off
    tensorwise = "tensorwise"  # one scale a tensor; the weights all-gathered in float8
    rowwise = "rowwise"  # one scale a row; gathered in bf16
    mxfp8 = "mxfp8"  # one scale per 32 values (torchao's prototype)


class TokenDtype(enum.StrEnum):
    """The integer dtype of a .bin token file's ids."""

    uint16 = "uint16"
    uint32 = "uint32"
    int32 = "int32"
    int64 = "int64"


class StateBits(enum.IntEnum):
    """Bits per AdamW state value (optim.state_bits); written as the number (32, 8, 4)."""

    fp32 = 32  # torch's AdamW
    bits8 = 8  # torchao's AdamW8bit
    bits4 = 4  # torchao's AdamW4bit


class StateTier(enum.StrEnum):
    """Where AdamW's states live between steps (``offload.states``, docs/memory-levers.md)."""

    none = "none"  # with the parameters (the device; the host under parallel.cpu_offload)
    # host memory (pinned on CUDA), swapped onto the device group by group for the step (ZeRO-Offload)
    cpu = "cpu"
    # one file per step group under offload.path, read ahead and written behind (ZeRO-Infinity)
    disk = "disk"


class OptimizerImpl(str, enum.Enum):
    auto = "auto"  # fused on CUDA, foreach on CPU
    fused = "fused"
    foreach = "foreach"
    for_loop = "for_loop"


@dataclass(frozen=True)
class _PPSchedule:
    """One of torch.distributed.pipelining's schedules (parallel.pp_schedule)."""

    # the stages a rank holds (parallel.pp_stages_per_rank): "1", "2+" (two or more), or "V" (two,
    # rank r holding stages r and 2 pp - 1 - r)
    per_rank: str
    # zero bubble: each backward split into its input and weight halves (see
    # fsdp_zero.sharding.pipeline.stage_wrap)
    zero_bubble: bool = False


PP_SCHEDULES = {
    "GPipe": _PPSchedule("1"),
    "1F1B": _PPSchedule("1"),
    "Interleaved1F1B": _PPSchedule("2+"),
    "InterleavedZeroBubble": _PPSchedule("2+", zero_bubble=True),
    "ZBVZeroBubble": _PPSchedule("V", zero_bubble=True),
}
_STAGES_NEEDED = {"1": "1", "2+": "2 or more", "V": "2"}


def stages_needed(schedule: str) -> int:
    """The stages a rank holds under ``schedule`` when parallel.pp_stages_per_rank is not set."""
    return 1 if schedule not in PP_SCHEDULES or PP_SCHEDULES[schedule].per_rank == "1" else 2


def check_stages(schedule: str, per_rank: int) -> None:
    """A ValueError naming parallel.pp_schedule when it is not a schedule, or
    parallel.pp_stages_per_rank when ``schedule`` does not run ``per_rank`` stages a rank."""
    if schedule not in PP_SCHEDULES:
        raise ValueError(
            f"parallel.pp_schedule={schedule!r} is not a valid choice; valid choices: "
            f"{', '.join(PP_SCHEDULES)}"
        )
    shape = PP_SCHEDULES[schedule].per_rank
    if (shape == "1") != (per_rank == 1) or (shape == "V" and per_rank != 2):
        raise ValueError(
            f"parallel.pp_stages_per_rank={per_rank}: parallel.pp_schedule={schedule} runs "
            f"{_STAGES_NEEDED[shape]} stages a rank"
        )
