"""The typed configuration schema: each section's fields, and beside them the rules they obey.

A run's config is the dataclass defaults below, merged with an optional YAML file
that holds only the keys it changes, merged with ``key=value`` overrides from the
command line (`fsdp_zero.config.loader`). Every user mistake (an unknown key, a value of the wrong
type, a bad choice, a batch that does not divide) is a ``ValueError`` naming the key, the bad
value and what would be valid, raised before anything is built or written.

Each field declares its simple constraint beside it (``field(default=..., metadata=gt(0))``, read
by `fsdp_zero.config.constraints.check_fields`, which also checks an enum field's choices); each
section's ``check()``, written right under its fields (as FSDP2's policy dataclasses validate
themselves), runs that and the rules between its own keys. The rules that need the world size are
``ParallelConfig.check_world`` (run by `fsdp_zero.distributed.topology.Topology.of`) and
`fsdp_zero.data.loader.BatchLayout.of`'s. `fsdp_zero.config.rules.validate` runs every section's
check, then the rules that span sections (`fsdp_zero.config.rules.REFUSALS`: what one setting does
not combine with). The built-in model's own rules (a known preset, its fields) live with its
settings: `fsdp_zero.config.presets.check_model_config`.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fsdp_zero.config.checks import check_regexes, grid_axis, is_target, world_notes
from fsdp_zero.config.choices import (
    ActivationCheckpointing,
    Backend,
    DataSource,
    Device,
    DType,
    Float8Recipe,
    Init,
    OptimizerImpl,
    PrecisionMode,
    Schedule,
    StateBits,
    StateTier,
    Task,
    TokenDtype,
    Warmup,
    WrapPolicy,
    check_stages,
    stages_needed,
)
from fsdp_zero.config.constraints import check_fields, ge, gt, within
from fsdp_zero.config.lora import LoRAConfig
from fsdp_zero.config.strategies import GradSync, Strategy


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
    # the built-in mixture of experts (presets moe_nano, moe_small; n_experts > 0 on any preset):
    # experts a block holds, and picked a token; the load-balancing loss's weight; the experts'
    # capacity (tokens x top-k / experts x this; 0: none). Null: the preset's.
    n_experts: int | None = None
    experts_top_k: int | None = None
    aux_loss_coef: float | None = None
    capacity_factor: float | None = None
    # A standard, non-sharded state dict to start from: a torch.save(model.state_dict())
    # .pt file, a .safetensors file, or a folder of safetensors shards with an index.
    init_from: str | None = None
    # A Hugging Face model folder (config.json, *.safetensors): the class from config.json's
    # architectures, its config from config.json (model.kwargs override keys), its weights streamed
    # into the shards as model.init_from's; instead of model.target and model.init_from.
    pretrained: str | None = None
    # model.pretrained only: run the folder's own code when its config.json has an auto_map (read it
    # first).
    trust_remote_code: bool = False
    # Parameters not trained (regexes, full matches on parameter names as the checkpoint keys them):
    # no gradients, no AdamW states, still sharded (docs/lora.md).
    freeze: list[str] = field(default_factory=list)
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    def check(self) -> None:
        """The rules that need no model; the built-in model's (preset, its fields, kwargs) are
        `fsdp_zero.model.transformer.check_model_config`'s."""
        check_fields(self, "model")
        if self.target is not None and not is_target(self.target):
            raise ValueError(
                f"model.target={self.target!r}: expected package.module:callable, e.g. "
                "torchvision.models:VisionTransformer"
            )
        if self.task is Task.custom and self.loss is None:
            raise ValueError(
                "model.task=custom needs model.loss: package.module:function taking (model, "
                "batch), returning the loss"
            )
        if self.loss is not None:
            if self.task is not Task.custom:
                raise ValueError(
                    f"model.loss={self.loss!r} is set but model.task={self.task.value}; set "
                    "model.task=custom to use it"
                )
            if not is_target(self.loss):
                raise ValueError(f"model.loss={self.loss!r}: expected package.module:function")
        if self.init_from is not None and not Path(self.init_from).exists():
            raise ValueError(f"model.init_from={self.init_from!r}: no such file or folder")
        if self.pretrained is not None:
            self._check_pretrained()
        elif self.trust_remote_code:
            raise ValueError(
                "model.trust_remote_code=true applies only to model.pretrained (a folder whose "
                "config.json has an auto_map); set model.pretrained or drop it"
            )
        check_regexes("model.freeze", self.freeze)
        self.lora.check()

    def _check_pretrained(self) -> None:
        """model.pretrained names a folder with a config.json, and brings its own class and weights."""
        for key, why in (
            ("target", "the class comes from the folder's config.json (architectures)"),
            ("init_from", "the weights come from the folder"),
        ):
            if getattr(self, key) is not None:
                raise ValueError(
                    f"model.pretrained={self.pretrained!r} and model.{key}={getattr(self, key)!r} "
                    f"are both set; {why}: set one of them"
                )
        folder = Path(self.pretrained)
        if not folder.is_dir():
            raise ValueError(
                f"model.pretrained={self.pretrained!r}: no such folder (a Hugging Face model "
                "folder, save_pretrained's output)"
            )
        if not (folder / "config.json").is_file():
            raise ValueError(
                f"model.pretrained={self.pretrained!r}: no config.json in it; a Hugging Face model "
                "folder (save_pretrained's output) holds config.json and *.safetensors"
            )


TOKEN_SOURCES = (DataSource.synthetic, DataSource.text, DataSource.tokens)
# What each source needs in data.path, and which tasks it feeds (custom takes any).
_PATHS = {
    DataSource.text: "a text file or a folder of them",
    DataSource.tokens: "a .bin or .npy file of token ids",
    DataSource.images: "an ImageFolder directory, one sub-folder of images per class",
}


@dataclass
class DataConfig:
    source: DataSource = DataSource.synthetic
    path: str | None = None  # file or folder, for source=text
    seq_len: int = field(default=128, metadata=gt(0))
    # tokens: the dtype of a .bin file (a .npy file carries its own). None: the dtype that the
    # meta.json beside the file names (scripts/prepare_data.py writes one), else uint16.
    token_dtype: TokenDtype | None = None
    # images / fake_images: square side in pixels after resizing and cropping.
    image_size: int = field(default=32, metadata=gt(0))
    # fake_images: how many label values FakeData draws
    num_classes: int = field(default=10, metadata=gt(0))
    # fake_images: how many distinct images before they repeat
    num_samples: int = field(default=1000, metadata=gt(0))
    # DataLoader worker processes per rank; None: 2 for images (decoding), 0 otherwise.
    num_workers: int | None = field(default=None, metadata=ge(0, "0: load in the training process"))
    # synthetic: each token is followed by one of `branching` successors (skewed odds),
    # so the loss falls from ln(vocab) towards ~ln(branching).
    branching: int = field(default=4, metadata=gt(0))

    @property
    def workers(self) -> int:
        """num_workers, or its default: 2 processes to decode images, none for tokens."""
        if self.num_workers is not None:
            return self.num_workers
        return 2 if self.source is DataSource.images else 0

    def check(self) -> None:
        """The declared constraints, and a path that exists and suits the source (only sources that
        read files take one)."""
        check_fields(self, "data")
        if self.source in _PATHS:
            if not self.path:
                raise ValueError(
                    f"data.source={self.source.value} needs data.path ({_PATHS[self.source]})"
                )
            path = Path(self.path)
            if not path.exists():
                raise ValueError(f"data.path={self.path!r}: no such file or folder")
            if self.source is DataSource.tokens and (
                not path.is_file() or path.suffix not in (".bin", ".npy")
            ):
                raise ValueError(
                    f"data.path={self.path!r}: data.source=tokens needs {_PATHS[self.source]}"
                )
            if self.source is DataSource.images and not path.is_dir():
                raise ValueError(
                    f"data.path={self.path!r}: data.source=images needs {_PATHS[self.source]}"
                )
        elif self.path:
            valid = ", ".join(s.value for s in _PATHS)
            raise ValueError(
                f"data.path={self.path!r} is set but data.source={self.source.value} reads no "
                f"files; data.source with a path: {valid}"
            )


@dataclass
class WrapConfig:
    policy: WrapPolicy = WrapPolicy.transformer
    # empty: the model's declared block class, or the class it repeats in a ModuleList or Sequential
    classes: list[str] = field(default_factory=list)
    min_params: int = field(default=1_000_000, metadata=gt(0))
    modules: list[str] = field(default_factory=list)  # FQN regexes (re.fullmatch)

    def check(self) -> None:
        check_fields(self, "parallel.wrap")
        if self.policy is WrapPolicy.modules and not self.modules:
            raise ValueError(
                "parallel.wrap.policy=modules needs parallel.wrap.modules, a list of FQN regexes, "
                "e.g. 'parallel.wrap.modules=[layers\\.\\d+]'"
            )
        check_regexes("parallel.wrap.modules", self.modules)


@dataclass
class ParallelConfig:
    # The data-parallel strategy (Sharding's table). parallel.zero_stage, DeepSpeed's name for the
    # same choice, is read as an alias of it: 0 ddp, 1 zero1, 2 shard_grad_op, 3 full_shard.
    strategy: Strategy = Strategy.full_shard
    shard_size: int = 2  # hybrid_shard: ranks per sharding group (usually the GPUs of a node)
    wrap: WrapConfig = field(default_factory=WrapConfig)
    # Explicit prefetch: each unit starts the all-gather of the next `prefetch` units (forward), and
    # of the previous ones (backward), before it computes. 0: FSDP2's own scheduling.
    prefetch: int = field(default=0, metadata=ge(0, "0: FSDP2's own scheduling"))
    # full_shard only: after forward, keep each unit's parameters sharded over groups of this many
    # ranks instead of all of them (ZeRO++'s hierarchical partitioning, hpZ): backward all-gathers
    # stay within a group (a node), at 16 P / N + 4 P / reshard_after_forward bytes. None: over all.
    reshard_after_forward: int | None = field(default=None, metadata=gt(0))
    # FSDP strategies: sharded parameters, gradients and optimizer states live in host memory and
    # the optimizer steps on the CPU (DeepSpeed's offload_param + offload_optimizer to cpu); each
    # unit is copied to the device for its forward and backward.
    cpu_offload: bool = False
    # Recompute activations in backward: none, full (every block of the wrap plan), or selective
    # (every k-th block, k = activation_checkpointing_every). Applied before compiling and sharding.
    activation_checkpointing: ActivationCheckpointing = ActivationCheckpointing.none
    activation_checkpointing_every: int = field(default=2, metadata=gt(0))
    # With activation checkpointing: the inputs each checkpointed block keeps for its recompute
    # are moved to host memory in forward (pinned, copied on a side stream on CUDA) and brought
    # back for the recompute in backward (`fsdp_zero.sharding.act_offload`). It lowers a peak set
    # at the end of forward by those bytes, not one set in the recompute (`plan.py` says which).
    activation_offload: bool = False
    # When gradients are reduced under gradient accumulation. every_micro_batch: each micro-batch's
    # backward reduce-scatters (FSDP; DDP and zero1 all-reduce once a step whatever this says).
    # replicas_once_per_step (hybrid_shard): reduce-scatter within the shard group every
    # micro-batch, all-reduce across replicas only after the last; no extra memory. once_per_step
    # (FSDP strategies): no reduction until the last micro-batch; each rank holds its units'
    # unsharded gradients in between in the reduce dtype (4 B x P in fp32 and under -mixed
    # precisions; 2 B under bf16-true). The same results within float rounding (a 16-bit reduce
    # dtype sums the micro-batches in 16 bits); fewer bytes.
    grad_sync: GradSync = GradSync.every_micro_batch
    # Expert parallelism (docs/parallelism.md#mixture-of-experts-and-expert-parallelism): a
    # mixture's routed experts divided over groups of ep_size ranks, each token sent to the rank
    # that holds its expert and back (an all-to-all each way). The group's ranks read different
    # data and are data-parallel ranks FSDP shards the other parameters over; each expert's
    # weights are sharded over the ranks ep_size leaves (torchtitan's dp_shard_mod_ep). The
    # model's experts must divide by ep_size.
    ep_size: int = field(
        default=1, metadata=gt(0) | grid_axis("ep", joins=("batch", "loss", "shard"))
    )
    # Ulysses sequence parallelism (docs/parallelism.md#sequence-parallelism-ulysses): each rank
    # of a group of sp_size ranks holds a slice of every sequence, and attention trades it for a
    # slice of the heads (an all-to-all before and after); the group's ranks are ranks the model
    # is sharded over (ALST's layout: FSDP shards over the data-parallel ranks times sp_size), and
    # read one batch between them. data.seq_len and the model's heads must divide by sp_size.
    sp_size: int = field(default=1, metadata=gt(0) | grid_axis("sp", joins=("loss", "shard")))
    # Tensor parallelism (docs/parallelism.md): the model's planned layers split their weights over
    # groups of tp_size ranks (the mesh's innermost dimension: the GPUs of a node), and the strategy
    # shards over the world size / tp_size data-parallel ranks.
    tp_size: int = field(default=1, metadata=gt(0) | grid_axis("tp"))
    # tp_size > 1: the norms and the residual stream between the layers sharded on the sequence
    # (activations / tp_size; torchtitan's default). data.seq_len must divide by tp_size.
    sequence_parallel: bool = True
    # tp_size > 1: the logits stay split over the vocabulary, the cross-entropy runs on the shards
    loss_parallel: bool = False
    # Pipeline parallelism (docs/parallelism.md): the model cut into pp_size x pp_stages_per_rank
    # stages over groups of pp_size ranks (the mesh's outermost dimension: across nodes), through
    # which pp_schedule runs each data-parallel rank's micro-batches; gradients reduce once a step.
    pp_size: int = field(default=1, metadata=gt(0) | grid_axis("pp", outer=True))
    # torch.distributed.pipelining's schedule: GPipe, 1F1B, Interleaved1F1B, InterleavedZeroBubble
    # or ZBVZeroBubble (docs/parallelism.md#pipeline-stages-and-schedules)
    pp_schedule: str = "1F1B"
    # stages a rank holds (GPipe, 1F1B: 1; interleaved: 2 or more; ZBV: 2); null: as the schedule
    pp_stages_per_rank: int | None = field(default=None, metadata=gt(0))

    def check(self) -> None:
        """The declared constraints and choices (a section built by hand, as `fsdp_zero.api.shard`
        does, may name them), and the stages a rank holds under the schedule; what each strategy
        takes is `fsdp_zero.config.rules.REFUSALS`'."""
        check_fields(self, "parallel")
        check_stages(self.pp_schedule, self.stages_per_rank)
        self.wrap.check()

    @property
    def stages_per_rank(self) -> int:
        """``pp_stages_per_rank``, or what ``pp_schedule`` needs (`stages_needed`)."""
        return self.pp_stages_per_rank or stages_needed(self.pp_schedule)

    def check_world(self, world_size: int) -> list[str]:
        """The rules that need the world size.

        Returns:
            Warnings for settings that have no effect (to log).

        Raises:
            ValueError: a tp_size or pp_size that does not divide the world size; a
                hybrid_shard shard size, or a reshard_after_forward group size, that does not
                divide the data-parallel ranks (the world size / (tp_size x pp_size)).
        """
        return world_notes(self, world_size)


@dataclass
class PrecisionConfig:
    """``precision=bf16-mixed`` is short for ``precision.mode=bf16-mixed``.

    fp32: everything fp32. bf16-mixed / fp16-mixed: fp32 sharded master weights, gradients and
    AdamW states; each unit's parameters gathered in bf16/fp16 for forward and backward; gradients
    reduced in fp32. bf16-true: parameters, gradients and AdamW states all bf16 (half the memory,
    and the precision to match). fp16 gradients are loss-scaled (a dynamic scale, as DeepSpeed's).
    """

    mode: PrecisionMode = PrecisionMode.fp32
    param_dtype: DType | None = None  # the gathered (compute) dtype; None: the mode's.
    # the gradient reduction dtype; None: fp32 (bf16 for bf16-true).
    reduce_dtype: DType | None = None
    # fp16 loss scaling: 0 = dynamic, starting at 2**initial_scale_power, doubled after
    # loss_scale_window steps without overflow, halved (and the step skipped) on an overflow;
    # > 0 = a fixed scale (overflowing steps are still skipped).
    loss_scale: float = field(default=0.0, metadata=ge(0, "0: dynamic loss scaling"))
    initial_scale_power: int = 16
    loss_scale_window: int = field(default=1000, metadata=gt(0))
    # float8 compute (torchao, as torchtitan): each block Linear's matmuls in float8 with dynamic
    # scales, per tensor (tensorwise: the weights also all-gathered in float8, 1 B instead of 2), per
    # row (rowwise: gathered in bf16) or per 32 values (mxfp8, torchao's prototype: dims and a
    # micro-batch's tokens multiples of 32); emulated (real quantization, fp32 matmul) where the device
    # has no float8 units. No memory saved. none: off. docs/memory-levers.md.
    float8: Float8Recipe = Float8Recipe.none

    def check(self) -> None:
        """The declared constraints and choices; what they combine with is `fsdp_zero.config.rules`'."""
        check_fields(self, "precision")


@dataclass
class OptimConfig:
    """AdamW with linear warm-up, then a cosine (or linear, or no) decay to ``min_lr_ratio * lr``."""

    lr: float = field(default=3e-3, metadata=gt(0))
    min_lr_ratio: float = field(default=0.1, metadata=within(0, 1))
    warmup_steps: int = field(default=10, metadata=ge(0))
    schedule: Schedule = Schedule.cosine
    # linear, or DeepSpeed's schedulers step for step (deepspeed_log, deepspeed_linear; docs/deepspeed.md)
    warmup: Warmup = Warmup.linear
    # deepspeed_*: where the warm-up starts, a factor of lr (DeepSpeed's warmup_min_lr / lr, warmup_min_ratio)
    warmup_start_ratio: float = field(default=0.0, metadata=within(0, 1))
    weight_decay: float = field(default=0.1, metadata=ge(0))
    # Decay the 1-D parameters (norm gains, biases) by weight_decay too, as an optimizer built over
    # model.parameters() does (DeepSpeed's from a ds_config's optimizer section: --deepspeed sets
    # it). false: matrices and embeddings only (Hugging Face's Trainer's groups).
    decay_1d: bool = False
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = field(default=1e-8, metadata=gt(0))
    # max global L2 norm of the gradients; 0 disables clipping
    grad_clip: float = field(default=1.0, metadata=ge(0, "0 disables clipping"))
    implementation: OptimizerImpl = OptimizerImpl.auto
    # A bounded optimizer step (DeepSpeed's sub_group_size): foreach AdamW steps this rank's shard
    # in groups of at most this many elements (a larger tensor is a group of its own), bit-identical
    # to one step over the whole shard, so its temporaries (a tensor list as large as what it steps
    # at once) are bounded by a group. 0: the whole shard at once. Fused AdamW (CUDA's default) and
    # for_loop make no temporaries larger than one tensor and ignore it (docs/memory-levers.md).
    step_group_size: int = field(
        default=0, metadata=ge(0, "elements per AdamW group; 0: the whole shard at once")
    )
    # Bits per AdamW state value: 32 (torch's AdamW), or 8 / 4: torchao's AdamW8bit / AdamW4bit, each
    # state block-quantized (blocks of 256 / 128 values, one fp32 scale each): 2.03 / 1.06 B per
    # parameter instead of 8; a tensor whose shard is under 4,096 values (or not whole blocks) keeps
    # fp32 states. Their step is compiled (the first one takes 20-40 s on 2 cores). docs/memory-levers.md.
    state_bits: StateBits = StateBits.fp32

    def check(self) -> None:
        """The declared constraints and choices, and AdamW's two betas."""
        check_fields(self, "optim")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"optim.betas={list(self.betas)}: must be two numbers in [0, 1)")


@dataclass
class OffloadConfig:
    """Where AdamW's states live between steps: with the parameters, in host memory, or in files on
    a local disk, for all of optim.step_group_size's groups or the last ``ratio`` of them
    (docs/memory-levers.md, "Optimizer states off the device"). parallel.cpu_offload moves the
    parameters, gradients and the step to the host as well (FSDP2's offload)."""

    # none | cpu (ZeRO-Offload: host memory, swapped onto the device around each group's step) |
    # disk (ZeRO-Infinity for optimizer states: a file per group under offload.path)
    states: StateTier = StateTier.none
    # the fraction of step groups whose states go down a tier, the last ones (DeepSpeed's
    # offload_optimizer.ratio: group i is offloaded when i >= int((1 - ratio) * groups))
    ratio: float = field(default=1.0, metadata=within(0, 1))
    # disk: a folder on a local disk; each rank writes its files in a folder of its own under it,
    # removed at the end of the run (checked at start-up for the free space its files need)
    path: str | None = None
    # groups read ahead of the one stepping (and so buffers in flight: prefetch + 1 groups)
    prefetch: int = field(default=1, metadata=gt(0))
    # cpu on CUDA: host buffers pinned (asynchronous copies); disk: staging buffers pinned
    pin_memory: bool = True

    def check(self) -> None:
        """The declared constraints, and a folder for the disk tier."""
        check_fields(self, "offload")
        if self.states == StateTier.disk and not self.path:
            raise ValueError(
                "offload.path is required with offload.states=disk: a folder on a local disk "
                "(DeepSpeed's nvme_path)"
            )
        if self.path and self.states == StateTier.disk and not Path(self.path).is_dir():
            raise ValueError(f"offload.path={self.path!r}: no such folder")


@dataclass
class TrainConfig:
    steps: int = field(default=150, metadata=gt(0))
    # sequences per optimizer step, over all ranks
    global_batch_size: int = field(default=16, metadata=gt(0))
    # sequences per forward/backward on one rank
    micro_batch_size: int = field(default=4, metadata=gt(0))
    log_every: int = field(default=10, metadata=gt(0))
    # Stop this invocation after this step (saving a checkpoint) while the LR schedule
    # still spans train.steps: for jobs cut into pieces by a time limit. None: train.steps.
    stop_after: int | None = field(default=None, metadata=gt(0))
    seed: int | None = 1234  # None: rank 0 draws one and broadcasts it
    # torch.compile each block unit (after activation checkpointing, before sharding); off by
    # default.
    compile: bool = False
    # A time budget: after this many minutes of training the run saves a checkpoint and stops (exit
    # code 4, as on SIGTERM), before a scheduler's wall-clock limit; leave a save's time of margin.
    max_minutes: float | None = field(default=None, metadata=gt(0))
    # Non-finite steps (a NaN or inf loss on any rank, or gradient norm) to skip over the whole run
    # before stopping as diverged (exit code 3); a skipped step leaves weights and AdamW states as
    # they were. 0: stop at the first. Counted in TensorBoard (train/skipped_nonfinite).
    skip_nonfinite: int = field(default=0, metadata=ge(0, "0: stop at the first non-finite step"))
    # The tiled loss: model.task=causal_lm's head (the output projection) and fp32 cross-entropy
    # over chunks of this many tokens, one chunk's logits alive at a time and recomputed in
    # backward: the same loss and gradients, a lower peak for large vocabularies (Liger's and
    # DeepSpeed's tiled logits loss; `fsdp_zero.model.tasks.tiled_cross_entropy`). 0: the whole
    # micro-batch's logits at once.
    loss_chunk: int = field(default=0, metadata=ge(0, "0: the whole micro-batch's logits at once"))

    def check(self) -> None:
        """The declared constraints, and whole micro-batches in a step."""
        check_fields(self, "train")
        if self.global_batch_size % self.micro_batch_size:
            raise ValueError(
                f"train.global_batch_size={self.global_batch_size} is not a multiple of "
                f"train.micro_batch_size={self.micro_batch_size}"
            )


@dataclass
class CheckpointConfig:
    """Sharded DCP checkpoints under <run dir>/checkpoints/step-NNNNNNN/."""

    enabled: bool = True
    # steps between saves (and always one at the end); 0: only at the end
    every: int = field(default=50, metadata=ge(0, "0: only at the end"))
    # of the checkpoints this launch saves, the newest kept (0: all); others' are never deleted
    keep_last: int = field(default=2, metadata=ge(0, "0: keep all"))
    # auto: continue from the newest complete checkpoint in the run directory, if any;
    # none: start fresh (refused if the run directory already holds checkpoints);
    # anything else: the path of a checkpoint folder to continue from.
    resume: str = "auto"
    async_save: bool = False  # write in a background thread while training goes on

    def check(self) -> None:
        """The declared constraints, and a resume folder that exists."""
        check_fields(self, "checkpoint")
        if self.resume not in ("auto", "none") and not Path(self.resume).is_dir():
            raise ValueError(
                f"checkpoint.resume={self.resume!r}: no such checkpoint folder; valid choices: "
                "auto, none, or the path of a checkpoint (…/checkpoints/step-NNNNNNN)"
            )


@dataclass
class _RunConfig:
    root: str = "runs"
    name: str | None = None  # None: a timestamp; the run directory is root/name

    def check(self) -> None:
        check_fields(self, "run")
        if self.name is not None and ("/" in self.name or self.name in ("", ".", "..")):
            raise ValueError(
                f"run.name={self.name!r}: must be a plain folder name (set run.root for the parent)"
            )


@dataclass
class DistConfig:
    backend: Backend = Backend.auto
    device: Device = Device.auto
    # How long a collective may wait for the other ranks before this rank gives up with one line
    # naming its step and the collective it was in (a rank that died or hangs): timeout_minutes
    # during start-up (building, loading a checkpoint) and checkpoint saves, which wait for the
    # slowest rank's I/O; step_timeout_minutes from the end of the first step on.
    timeout_minutes: float = field(default=30.0, metadata=gt(0))
    step_timeout_minutes: float = field(default=5.0, metadata=gt(0))

    def check(self) -> None:
        check_fields(self, "dist")


@dataclass
class _MetricsConfig:
    tensorboard: bool = True
    # Optimizer steps (1-based) recorded with torch.profiler: each rank writes a chrome trace per run
    # of consecutive steps, <run dir>/traces/rank<R>_step<first>-<last>.json.gz, and rank 0 prints
    # its summary (device busy and idle, time by category, host syncs, FSDP's phases; also beside
    # it as .summary.json). These steps are left out of the throughput. []: none.
    trace_steps: list[int] = field(default_factory=list)

    def check(self) -> None:
        """A switch, and optimizer steps to trace that are steps (1-based)."""
        check_fields(self, "metrics")
        bad = [s for s in self.trace_steps if s < 1]
        if bad:
            raise ValueError(
                f"metrics.trace_steps={list(self.trace_steps)}: {bad[0]} is not an optimizer "
                "step; valid: steps >= 1 (the first step is 1), e.g. [2, 3]"
            )


@dataclass
class _MemoryConfig:
    # glibc only: allocations of at least this many bytes get their own mmap and go back to the
    # system when freed (see fsdp_zero.monitor.memory.set_malloc_mmap_threshold). "auto": 8 MiB on
    # CPU runs, glibc's default on CUDA runs (tensors live in CUDA memory there); "default": glibc's
    # default; or a byte count.
    malloc_mmap_threshold: str = "auto"
    # The step whose memory is broken down by category (params, gathered params, grads,
    # optimizer, activations, comm buffers) with PyTorch's MemTracker; 0: none. One step
    # only: the tracker intercepts every op and is slow.
    profile_step: int = field(default=2, metadata=ge(0, "0: no profiling"))
    # CUDA: record the caching allocator's history from the start, and when a step runs out of
    # memory dump it to <run dir>/memory/oom_rank<R>.pickle (https://pytorch.org/memory_viz draws
    # it), ending the run with a line that names the file. On CPU it does nothing.
    snapshot_on_oom: bool = False

    def check(self) -> None:
        check_fields(self, "memory")
        threshold = self.malloc_mmap_threshold
        if threshold not in ("auto", "default") and not (
            threshold.isdigit() and int(threshold) > 0
        ):
            raise ValueError(
                f"memory.malloc_mmap_threshold={threshold!r}: valid choices: auto, default, or a "
                "byte count > 0"
            )


# What eval.path holds for each task that can be evaluated (fsdp_zero.training.evaluate).
_EVAL_PATHS = {
    Task.causal_lm: "a token file (.bin or .npy) as data.source=tokens reads one",
    Task.classification: "an ImageFolder directory, one sub-folder of images per class",
}


@dataclass
class _EvalConfig:
    """Validation on held-out data at every ``every``-th step and at the last (see fsdp_zero.training.evaluate)."""

    # steps between evaluations, and one at the last step; 0: no evaluation
    every: int = field(default=0, metadata=ge(0, "0: no evaluation"))
    # causal_lm: a token file (.bin of data.token_dtype, or .npy), cut into windows of data.seq_len
    # + 1 tokens at stride data.seq_len; classification: an ImageFolder directory (resized,
    # centre-cropped).
    path: str | None = None
    # Evaluate only the first max_batches x train.global_batch_size windows (images): the same set
    # at any world size and micro-batch size. 0: the whole file.
    max_batches: int = field(default=0, metadata=ge(0, "0: the whole file"))

    def check(self) -> None:
        """The declared constraints, and a path that exists whenever evaluation is on."""
        check_fields(self, "eval")
        if self.every and not self.path:
            raise ValueError(
                f"eval.every={self.every} needs eval.path: {_EVAL_PATHS[Task.causal_lm]} for "
                f"model.task=causal_lm, {_EVAL_PATHS[Task.classification]} for classification"
            )
        if self.path and not Path(self.path).exists():
            raise ValueError(f"eval.path={self.path!r}: no such file or folder")

    def check_task(self, task: Task) -> None:
        """The rule that needs model.task: evaluation on, for a task it can evaluate, on a path that suits it."""
        if not self.every:
            return
        if task not in _EVAL_PATHS:
            raise ValueError(
                f"eval.every={self.every}: model.task={task.value} cannot be evaluated (its "
                "batches are the loss function's own); valid choices: "
                f"{', '.join(t.value for t in _EVAL_PATHS)}, or eval.every=0"
            )
        path = Path(self.path)
        fits = (
            path.is_dir()
            if task is Task.classification
            else path.is_file() and path.suffix in (".bin", ".npy")
        )
        if not fits:
            raise ValueError(
                f"eval.path={self.path!r}: model.task={task.value} evaluates {_EVAL_PATHS[task]}"
            )


def _sections(cls: type) -> type:
    """A dataclass of sections: each field defaults to a fresh instance of its own type."""
    types = typing.get_type_hints(cls)
    for name in cls.__annotations__:
        setattr(cls, name, field(default_factory=types[name]))
    return dataclass(cls)


@_sections
class Config:
    """A run's settings: one section a key prefix (``model.*``, ``data.*``, ...)."""

    model: ModelConfig
    data: DataConfig
    parallel: ParallelConfig
    precision: PrecisionConfig
    optim: OptimConfig
    offload: OffloadConfig
    train: TrainConfig
    checkpoint: CheckpointConfig
    run: _RunConfig
    dist: DistConfig
    metrics: _MetricsConfig
    memory: _MemoryConfig
    eval: _EvalConfig
