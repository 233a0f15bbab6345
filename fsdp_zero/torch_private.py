"""Every private PyTorch (and Hugging Face) API fsdp-zero uses, in one place, each with
what it is for; and torchao's (the ``lowbit`` extra), whose public APIs move between releases.

Private names move between releases. Importing them here (and nowhere else) means a
torch upgrade breaks one module, loudly, and `tests/test_torch_private.py` checks each is still
where we expect it. The memory trackers are imported on first use: importing
``torch.distributed._tools`` costs about a second, which a run without profiling skips.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

__all__ = [
    "ConvNd",
    "DCP_METADATA_PRIVATE",
    "DefaultAllGather",
    "DefaultReduceScatter",
    "count_zero_broadcasts",
    "skips_on_device",
    "skipped_on_device",
    "checkpoint_activations",
    "recomputing",
    "FakeStore",
    "FakeTensorMode",
    "is_fake",
    "NormBase",
    "SizeClasses",
    "_init_optim_state",
    "default_store",
    "flight_recorder_json",
    "flatten_mesh",
    "fsdp_mem_tracker",
    "fsdp_unit_settings",
    "hf_init_weights",
    "hf_attention_interface",
    "hf_no_split_modules",
    "set_hf_attention",
    "mem_tracker",
    "record_memory_history",
    "dump_memory_snapshot",
    "real_post_forward_meshes",
    "schedule_order",
    "storage_key",
    "reset_fsdp_iter_state",
    "set_group_timeout",
    "local_shape_and_offset",
    "local_parameters",
    "in_backward",
    "count_functional_collectives",
    "to_nf4",
    "low_bit_adamw",
    "convert_float8",
    "precompute_float8_scales",
]

# FakeTensorMode: tensors with shapes, dtypes and devices but no storage; the planner runs
# a training step on them to count memory without allocating any.
# The flight recorder: every process group's recent collectives (op, group, sequence number, sizes,
# whether it completed), recorded by gloo and NCCL themselves. Read when a collective fails or times
# out, to say which one this rank was in and to leave the record beside the run.
from torch._C._distributed_c10d import _dump_fr_trace_json as flight_recorder_json
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

# Activation checkpointing as a composable API: marks a module so that its forward is recomputed
# in backward (non-reentrant) without wrapping it, so parameter names, and with them checkpoints,
# are the same with and without it (FSDP's CheckpointWrapper adds `_checkpoint_wrapped_module.`).
# It composes with fully_shard on the same module, as FSDP2's own tests use it.
from torch.distributed._composable import checkpoint as checkpoint_activations

# Creates an optimizer's lazily-created states (DCP's state-dict API calls it for the same
# reason): a ZeroRedundancyOptimizer's partition must have states before a checkpoint can
# be loaded into them.
from torch.distributed.checkpoint.state_dict import _init_optim_state

# The store the ranks met in at init_process_group: after a collective failed, the ranks that can
# still say so tell each other through it, which names the ranks that died or hang.
from torch.distributed.distributed_c10d import _get_default_store as default_store

# FSDP2's default reduce-scatter. The public hook `FSDPModule.set_custom_reduce_scatter` takes an
# instance of the private `ReduceScatter` interface; gloo runs install a subclass that reduces with
# an all-reduce (`fsdp_zero.sharding.parallelize.AllReduceScatter`). FSDP2's default all-gather, for
# the same public hook's twin, `FSDPModule.set_custom_all_gather`: `fsdp_zero.monitor.comm` installs
# a subclass that counts the bytes each unit gathers, then gathers as FSDP2 does.
from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
    DefaultAllGather,
    DefaultReduceScatter,
)

# A DTensor's shard as a box of the full tensor (its shape and offset) under any placements, which
# the world-size-invariant initialiser and the weights loader write (`fsdp_zero.model.init`).
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

# The base classes of Conv1d/2d/3d and ConvTranspose*, and of BatchNorm/InstanceNorm/SyncBatchNorm:
# `fsdp_zero.model.init.init_standard` recognises every standard convolution and norm through them.
from torch.nn.modules.batchnorm import _NormBase as NormBase
from torch.nn.modules.conv import _ConvNd as ConvNd

# The planner simulates one rank of N in one process with a process group whose
# collectives return at once. A testing utility, but the documented way to do this
# (torchtitan's memory estimation and FSDPMemTracker's own tests use it).
from torch.testing._internal.distributed.fake_pg import FakeStore

# Every op seen by Python (the functional collectives DTensor issues, counted by kind).
from torch.utils._python_dispatch import TorchDispatchMode

# A process group's collective timeout, changed after init: public as `dist.set_timeout` from torch
# 2.15 (the pinned version); the GPU machines' torch 2.11 has only the private function it calls.
set_group_timeout = getattr(dist, "set_timeout", None) or c10d._set_pg_timeout

# Private names that DCP's own .metadata pickles (a tensor's storage layout, a chunk's place in
# a file): the checkpoint reader's allow-listed unpickler admits them by these exact names.
DCP_METADATA_PRIVATE = {
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
}


def recomputing(module: Any) -> bool:
    """Whether ``module``'s forward (a module `checkpoint_activations` marked) runs as the
    recompute in backward: the composable checkpoint turns its own hooks off around it
    (``_no_hook``); activation offload's hooks stand aside then too."""
    return not checkpoint_activations.state(module).enable_hook


def hf_init_weights(model: Any, seed: int) -> bool:
    """Initialises a Hugging Face model with its own initialiser (``PreTrainedModel._init_weights``,
    applied module by module, after ``torch.manual_seed(seed)``); False: the model has none. Modules
    and tensors that Hugging Face marked as initialised (``_is_hf_initialized``) are unmarked first,
    or it would skip them."""
    import torch

    init = getattr(model, "_init_weights", None)
    if not callable(init):
        return False
    torch.manual_seed(seed)
    for m in model.modules():
        m.__dict__.pop("_is_hf_initialized", None)
    for p in list(model.parameters()) + list(model.buffers()):
        p.__dict__.pop("_is_hf_initialized", None)
    with torch.no_grad():
        model.apply(init)
    return True


def hf_no_split_modules(model: Any) -> list[str]:
    """The block classes a Hugging Face model declares must not be split (``_no_split_modules``,
    what Accelerate wraps by default); [] for any other model."""
    return list(getattr(model, "_no_split_modules", None) or [])


def hf_attention_interface(model: Any) -> bool:
    """Whether a transformers model's attention modules look their function up by the config's
    ``_attn_implementation`` in transformers' attention interface (``_supports_attention_backend``:
    Llama, Mistral, Qwen2/3, Gemma and most decoder-only models of transformers 5)."""
    return bool(getattr(model, "_supports_attention_backend", False)) and hasattr(
        getattr(model, "config", None), "_attn_implementation"
    )


def set_hf_attention(model: Any, name: str) -> None:
    """Every config of ``model`` (a composite model's sub-configs too) set to the attention function
    registered as ``name``."""
    for m in model.modules():
        config = getattr(m, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            config._attn_implementation = name


def fsdp_unit_settings(module: Any) -> dict[str, Any]:
    """What FSDP2 applies to one unit (a module ``fully_shard`` was called on), read back from its state
    (``_get_fsdp_state()._fsdp_param_group``): the dtypes its parameters are gathered in and its
    gradients reduced in (None: the stored dtype), whether its shards are offloaded to the CPU (and
    pinned), and what it reshards to after forward (True: its full shard group, ZeRO-3; False: stays
    gathered until backward, ZeRO-2; k: groups of k ranks, hpZ). The tests read it to check that
    each setting reached FSDP2; ``{}`` for a unit that holds no parameters of its own."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    group = module._get_fsdp_state()._fsdp_param_group
    if group is None:
        return {}
    policy = group.fsdp_params[0].mp_policy
    post = group.post_forward_mesh_info
    reshard = False if post is None else True if post == group.mesh_info else post.shard_mesh_size
    offload = isinstance(group.offload_policy, CPUOffloadPolicy)
    return {
        "param_dtype": policy.param_dtype,
        "reduce_dtype": policy.reduce_dtype,
        "offload": offload,
        "pin_memory": offload and group.offload_policy.pin_memory,
        "reshard_after_forward": reshard,
    }


@contextlib.contextmanager
def real_post_forward_meshes() -> Iterator[None]:
    """hpZ (``reshard_after_forward=k``) and expert parallelism's experts under the planner's
    FakeTensorMode: ``fully_shard`` makes the
    post-forward mesh from a view of its mesh's rank tensor
    (``_fsdp_init._get_post_forward_mesh_info``), which fake mode turns into a tensor whose ranks
    cannot be read (``DataDependentOutputException``). Inside this, that one function runs outside
    fake mode: the meshes are made of real rank tensors, as outside a simulation."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp._fully_shard import _fully_shard

    original = _fully_shard._get_post_forward_mesh_info
    # FSDP2 + EP's 2-D mesh (``_fsdp_param._init_sharding_spec_tp``) the same way
    concatenate = DeviceMesh._concatenate

    def outside_fake_mode(*args: Any, **kwargs: Any) -> Any:
        with unset_fake_temporarily():
            return original(*args, **kwargs)

    def concatenated(*args: Any, **kwargs: Any) -> Any:
        with unset_fake_temporarily():
            return concatenate(*args, **kwargs)

    _fully_shard._get_post_forward_mesh_info = outside_fake_mode
    DeviceMesh._concatenate = staticmethod(concatenated)
    try:
        yield
    finally:
        _fully_shard._get_post_forward_mesh_info = original
        DeviceMesh._concatenate = staticmethod(concatenate)


def reset_fsdp_iter_state(root: Any) -> None:
    """After a forward without backward (evaluation): every unit resharded and FSDP2's record of the
    pass's forward order (which backward prefetches by) forgotten. Public from torch 2.15 (the
    pinned version) as ``FSDPModule.reset_iter_state``; on the GPU machines' torch 2.11, by hand:
    each unit's ``reshard()`` (public) and the two private records that method clears."""
    if hasattr(root, "reset_iter_state"):
        root.reset_iter_state()
        return
    from torch.distributed.fsdp import FSDPModule

    for module in root.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
            group = module._get_fsdp_state()._fsdp_param_group
            if group is not None:
                group._post_forward_indices.clear()
                group.comm_ctx.post_forward_order.clear()


def count_zero_broadcasts(optimizer: Any, count: Any) -> None:
    """Counts what a ZeroRedundancyOptimizer broadcasts after its step: ``count(tensor)`` for each tensor
    it is about to broadcast. Its step calls the private ``_broadcast_params_from_rank(r)`` once for
    every rank r (``_sync_params``), which broadcasts rank r's bucket
    (``parameters_as_bucket_view``, ``_buckets``) or the parameters of r's partition
    (``_partition_parameters()[r]``); the method is wrapped on this instance to count the same
    tensors, from the same structures, before it runs."""
    broadcast = optimizer._broadcast_params_from_rank

    def counted(rank: int) -> Any:
        if optimizer.parameters_as_bucket_view:
            for per_rank in optimizer._buckets:
                count(per_rank[rank])
        else:
            for group in optimizer._partition_parameters()[rank]:
                for param in group["params"]:
                    count(param)
        return broadcast(rank)

    optimizer._broadcast_params_from_rank = counted


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` can skip its step on the device: torch's fused Adam and AdamW read a
    ``found_inf`` attribute (what GradScaler sets on optimizers with ``_step_supports_amp_scaling``)
    and leave parameters, moments and step counts as they were where it is 1, without a host read."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


@contextlib.contextmanager
def skipped_on_device(optimizer: torch.optim.Optimizer, found_inf: torch.Tensor) -> Iterator[None]:
    """``optimizer.step()`` inside is skipped on the device where ``found_inf`` (float32, 0-dim) is 1
    (`skips_on_device` optimizers only)."""
    assert skips_on_device(optimizer), type(optimizer)
    optimizer.found_inf = found_inf
    try:
        yield
    finally:
        del optimizer.found_inf


def record_memory_history(max_entries: int) -> None:
    """CUDA's caching allocator records every allocation and free (with its stack), keeping the
    last ``max_entries``: what `dump_memory_snapshot` writes (memory.snapshot_on_oom)."""
    torch.cuda.memory._record_memory_history(max_entries=max_entries)


def dump_memory_snapshot(path: str) -> None:
    """The recorded allocator history and the segments now held, as a pickle that
    https://pytorch.org/memory_viz draws."""
    torch.cuda.memory._dump_snapshot(path)


def mem_tracker() -> Any:
    """PyTorch's MemTracker: attributes every live tensor to a category (params, grads,
    optimizer states, activations, temporaries) at each op, and records the peak."""
    from torch.distributed._tools.mem_tracker import MemTracker

    return MemTracker


def fsdp_mem_tracker() -> Any:
    """FSDPMemTracker: MemTracker that also knows FSDP2's sharded and gathered parameters
    and its all-gather and reduce-scatter buffers."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    return FSDPMemTracker


class SizeClasses:
    """Live tensor bytes a MemTracker sees, split by category and by size: below ``threshold``
    (what glibc serves from its heap) or at and above it (its own mmap). ``at_peak`` is the
    split at the moment the tracker's total peaked; `fsdp_zero.tools.planner` uses it to predict
    what the heap keeps resident beyond the live tensors. ``region_peaks``: the same at the moment
    the total peaked within each region of the step, a region being whatever its owner last named
    ``region`` (the planner composes each region's peak separately).

    Hooks two private methods of the tracker instance: ``_update_snap``, through which every
    change to its running snapshot passes (a storage added, freed, resized or re-categorised),
    and ``_update_peak_stats``, which it calls after each op.
    """

    def __init__(self, tracker: Any, threshold: int) -> None:
        self.threshold = threshold
        self.current: dict[tuple[str, bool], int] = {}
        self.at_peak: dict[tuple[str, bool], int] = {}
        self._peak_total = -1
        self.region = ""
        self.region_peaks: dict[str, dict[tuple[str, bool], int]] = {}
        self._region_totals: dict[str, int] = {}
        update_snap, update_peak = tracker._update_snap, tracker._update_peak_stats

        def on_update(
            u_type: Any, winfo: Any, old_mem_consumed: int | None = None, old_reftype: Any = None
        ) -> None:
            update_snap(u_type, winfo, old_mem_consumed=old_mem_consumed, old_reftype=old_reftype)
            name, kind = winfo.reftype.name, u_type.name
            if kind == "ADD":
                self._add(name, winfo.mem_consumed)
            elif kind == "DEL":
                self._add(name, -winfo.mem_consumed)
            elif kind == "REF":
                self._add(old_reftype.name, -winfo.mem_consumed)
                self._add(name, winfo.mem_consumed)
            elif kind == "SIZE":
                self._add(name, -old_mem_consumed)
                self._add(name, winfo.mem_consumed)

        def on_op(*args: Any, **kwargs: Any) -> None:
            update_peak(*args, **kwargs)
            total = sum(self.current.values())
            if total > self._peak_total:
                self._peak_total, self.at_peak = total, dict(self.current)
            if total > self._region_totals.get(self.region, -1):
                self._region_totals[self.region], self.region_peaks[self.region] = (
                    total,
                    dict(self.current),
                )

        tracker._update_snap = on_update
        tracker._update_peak_stats = on_op

    def _add(self, reftype: str, nbytes: int) -> None:
        if nbytes:
            key = (reftype, abs(nbytes) < self.threshold)
            self.current[key] = self.current.get(key, 0) + nbytes


def local_shape_and_offset(tensor: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A DTensor's local shard: its shape and its offset in the full tensor, under any placements
    (``Shard``, FSDP2's ``_StridedShard`` beside tensor parallelism's, ``Replicate``)."""
    return compute_local_shape_and_global_offset(
        tensor.shape, tensor.device_mesh, tensor.placements
    )


class _FunctionalCollectives(TorchDispatchMode):
    """Calls ``add(kind, bytes)`` for each functional collective an op issues (DTensor's, under
    tensor parallelism): the gathered output's bytes, a reduce-scatter's or all-reduce's input's.
    0-d tensors (a norm's or a loss's scalar) are left out."""

    def __init__(self, add: Any) -> None:
        super().__init__()
        self.add = add

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kind = _FUNCTIONAL_KINDS.get(func)
        if kind and args[0].dim():
            size = args[0].numel() * args[0].element_size()
            self.add(kind, size * (args[1] if kind == "all_gather" else 1))
        return func(*args, **(kwargs or {}))


_FUNCTIONAL_KINDS = {
    torch.ops._c10d_functional.all_gather_into_tensor.default: "all_gather",
    torch.ops._c10d_functional.reduce_scatter_tensor.default: "reduce_scatter",
    torch.ops._c10d_functional.all_reduce.default: "all_reduce",
}


def count_functional_collectives(add: Any) -> contextlib.AbstractContextManager:
    """While active, ``add(kind, bytes)`` for each functional collective (all_gather,
    reduce_scatter, all_reduce): the collectives DTensor issues for tensor parallelism, which no
    FSDP or DDP hook sees. A dispatch mode: a little work on every op while it is on."""
    return _FunctionalCollectives(add)


def flatten_mesh(mesh: Any, dims: tuple[str, ...], name: str) -> Any:
    """``DeviceMesh._flatten``: ``mesh``'s dimensions ``dims`` as one more, ``name``, whose group
    spans them (torchtitan's ``dp_shard_cp``): hybrid_shard's data-parallel ranks under tensor or
    pipeline parallelism, which (dp_replicate, dp_shard) hold together. Every rank calls it once
    (it creates process groups)."""
    return mesh[dims]._flatten(name)


def schedule_order(
    schedule: str, pp: int, stage_ids: list[int], n_microbatches: int, pp_rank: int
) -> list[tuple[int, str, int]] | None:
    """A multi-stage pipeline schedule's actions for pipeline rank ``pp_rank``, in order: (stage,
    kind, micro-batch), kind ``F`` (forward), ``B`` (backward), ``I`` (its input half) or ``W``
    (its weight half). Read from the schedule's own ``pipeline_order``, which it computes from the
    stages' indices and counts alone, so stand-ins take the stages' place (no module, no group).
    None for a single-stage schedule (GPipe, 1F1B), which keeps no such table."""
    from types import SimpleNamespace

    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

    cls = get_schedule_class(schedule)
    if issubclass(cls, PipelineScheduleSingle):
        return None
    stages = [
        SimpleNamespace(
            group_size=pp,
            group_rank=pp_rank,
            stage_index=s,
            num_stages=pp * len(stage_ids),
            is_first=s == 0,
            is_last=s == pp * len(stage_ids) - 1,
            submod=None,
        )
        for s in stage_ids
    ]
    order = cls(stages, n_microbatches, loss_fn=lambda out, target: out).pipeline_order[pp_rank]
    kinds = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}
    out = []
    for action in order:
        if action is None:  # an idle slot
            continue
        kind = kinds.get(action.computation_type.name)
        assert kind, f"an action {action} this reading does not know"
        out.append((action.stage_index, kind, action.microbatch_index))
    return out


def is_fake(tensor: Any) -> bool:
    """Whether ``tensor`` is a FakeTensorMode tensor (the planner's simulation): shapes, no
    storage. (FakeTensor is private to torch.)"""
    return isinstance(tensor, FakeTensor)


def storage_key(tensor: Any) -> tuple[int, int]:
    """(an identity of ``tensor``'s storage, its bytes), of one tensor-parallel rank's part for a
    DTensor (``_local_tensor``, not ``to_local()``, which would record an op inside a saved-tensor
    hook). Views share their base's identity; on the meta device, where every ``data_ptr`` is 0,
    the storage object's own (``_cdata``) tells them apart."""
    local = getattr(tensor, "_local_tensor", tensor)
    storage = local.untyped_storage()
    return storage._cdata, storage.nbytes()


# ---------------------------------------------------------------------------------
# torchao (the `lowbit` extra: NF4, low-bit AdamW, float8), imported on first use: the core never imports
# it unless a key needs one; its APIs move between releases (NF4 left torchao.dtypes in 0.18).


def to_nf4(tensor: torch.Tensor, block: int, scaler_block: int) -> Any:
    """torchao's ``NF4Tensor`` of ``tensor`` (``F.linear`` dequantizes it; FSDP2 gathers its insides)."""
    try:
        from torchao.quantization import to_nf4 as nf4
    except ImportError:  # torchao 0.17
        from torchao.dtypes.nf4tensor import to_nf4 as nf4
    return nf4(tensor, block, scaler_block)


def low_bit_adamw(bits: int) -> type[torch.optim.Optimizer]:
    """torchao's AdamW8bit or AdamW4bit (update compiled per shape, learning rate a tensor), with
    AOTAutograd's disk cache off: torchao 0.18 on torch 2.15 crashes reading one kind's graph for another."""
    import torch._functorch.config as functorch_config
    import torchao.optim

    functorch_config.enable_autograd_cache = False
    return getattr(torchao.optim, f"AdamW{bits}bit")


def convert_float8(model: torch.nn.Module, linears: list[str], recipe: str, emulate: bool) -> None:
    """Swaps ``model``'s ``linears`` (FQNs) for torchao's ``Float8Linear`` ("not a public API"),
    scaled per tensor (tensorwise: FSDP2 gathers its weight in float8) or per row, or (mxfp8, a
    prototype) wraps their weights; ``emulate``: real quantization, fp32 matmuls."""
    import dataclasses

    import torchao.prototype.moe_training.config as mx
    from torchao.float8 import Float8LinearConfig as Config
    from torchao.float8 import convert_to_float8_training
    from torchao.quantization import quantize_

    chosen = lambda m, fqn: fqn in set(linears)  # noqa: E731
    mx_recipe = mx.MXFP8TrainingRecipe["MXFP8_EMULATED_RCEIL" if emulate else "MXFP8_RCEIL"]
    if recipe == "mxfp8":  # each weight wrapped, the module kept
        return quantize_(model, mx.MXFP8TrainingOpConfig.from_recipe(mx_recipe), chosen)
    config = Config(enable_fsdp_float8_all_gather=True, emulate=emulate)
    if recipe != "tensorwise":
        # str(): torchao reads a recipe name only when its type is exactly str
        config = dataclasses.replace(Config.from_recipe_name(str(recipe)), emulate=emulate)
    convert_to_float8_training(model, config=config, module_filter_fn=chosen)


def precompute_float8_scales(model: torch.nn.Module) -> None:
    """Every tensorwise float8 weight's scale for its next all-gather, in one all-reduce."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)


@contextlib.contextmanager
def local_parameters(module: torch.nn.Module) -> Iterator[list[torch.Tensor]]:
    """While open, ``module``'s own parameters read as their local tensors (a DTensor's
    ``to_local()``, differentiable; others as they are), so its forward computes on this rank's
    slice: expert parallelism's experts, whose token counts no DTensor can express (torchtitan's
    ``GroupedExperts`` calls ``to_local`` in its forward). Yields them. Reads ``nn.Module``'s
    private ``_parameters``: a plain attribute shadows no registered parameter."""
    saved = dict(module._parameters)
    local = [p.to_local() if hasattr(p, "to_local") else p for p in saved.values()]
    try:
        for name, t in zip(saved, local):
            del module._parameters[name]
            module.__dict__[name] = t
        yield local
    finally:
        for name, p in saved.items():
            module.__dict__.pop(name, None)
            module._parameters[name] = p


def in_backward() -> bool:
    """Whether this runs inside autograd's backward (a checkpointed block's recompute): what the
    expert-parallel dispatch counts apart from the forward (``torch._C``'s graph-task id)."""
    return torch._C._current_graph_task_id() != -1
