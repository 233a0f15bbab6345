"""Activation offload (``parallel.activation_offload``): the inputs activation checkpointing keeps
per checkpointed block (its boundary inputs, the only tensors it holds from forward to backward)
moved to host memory in forward and brought back for the block's recompute in backward.

How it finds them: torch's composable checkpoint (`fsdp_zero.torch_private.checkpoint_activations`)
runs from a block's forward pre-hook and forward hook. Its pre-hook saves the block's positional
tensor inputs (``_CheckpointFrame.save_inputs``: autograd ``SavedVariable``s, which go through
the innermost ``saved_tensors_hooks`` open at that moment), then opens its own saved-tensor hooks,
which keep nothing of what the block saves inside; its forward hook (prepended) closes them. So
a ``saved_tensors_hooks(pack, unpack)`` opened by a pre-hook that runs before checkpoint's
(``prepend=True``) and closed by a forward hook that runs after checkpoint's sees exactly the
boundary inputs. In the recompute, checkpoint turns its own hooks off (``recomputing``) and these
stand aside too, so the recompute's saved tensors stay checkpoint's. Keyword tensors are held in
checkpoint's closure, not saved: they stay where they are (the built-in model passes none; a
Hugging Face layer's rotary tables and masks, shared by every layer, stay on the device).

On CUDA (torchtune's `OffloadActivations`, DeepSpeed PR #8282, transformers'
``save_on_cpu(pin_memory=True)``): each input is copied to a pinned host tensor on a side stream
(its device memory kept from reuse until the copy is done) and brought back on the current stream
after waiting for that copy. On the CPU the host is the device: the same hooks copy into a host
tensor and back, so the mechanism and its byte count are tested there; the memory it saves is a
GPU's.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fsdp_zero.torch_private import recomputing, storage_key


@dataclass
class _Packed:
    """One offloaded input: its host copy, the device it goes back to, the copy's event (CUDA)."""

    host: torch.Tensor
    device: torch.device
    copied: torch.cuda.Event | None = None


@dataclass
class ActivationOffload:
    """The hooks on the checkpointed blocks and what they moved (`ACTIVATION_OFFLOAD`'s ``made``).

    ``packed_bytes`` counts the bytes moved to the host since the last `take` (the trainer takes
    them once a step: memory/offloaded_activations_mib).
    """

    root: nn.Module  # the whole model: its buffers are not activations
    packed_bytes: int = 0
    _stream: torch.cuda.Stream | None = None
    _open: list[contextlib.AbstractContextManager] = field(default_factory=list)

    def install(self, blocks: list[nn.Module]) -> None:
        """Hooks on each of ``blocks`` (modules `checkpoint_activations` already marked): the
        saved-tensor hooks open from before checkpoint's pre-hook to after its forward hook."""
        for block in blocks:
            block.register_forward_pre_hook(self._enter, prepend=True)
            block.register_forward_hook(self._exit, always_call=True)

    def take(self) -> int:
        """The bytes moved to the host since the last call (and a fresh count)."""
        taken, self.packed_bytes = self.packed_bytes, 0
        return taken

    def _enter(self, block: nn.Module, args: Any) -> None:
        hooks = contextlib.nullcontext()
        if torch.is_grad_enabled() and not recomputing(block):
            hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        hooks.__enter__()
        self._open.append(hooks)

    def _exit(self, block: nn.Module, args: Any, output: Any) -> None:
        if self._open:  # (always_call: also after a forward that raised)
            self._open.pop().__exit__(None, None, None)

    def _kept(self, tensor: torch.Tensor) -> bool:
        """What is not an activation, or not a plain floating tensor, stays where it is: a
        parameter, a view of one of the model's buffers (the built-in model's rotary table), an
        integer or complex tensor, a tensor subclass (DTensor)."""
        if type(tensor) is not torch.Tensor or not tensor.is_floating_point():
            return True
        # (storage identities, not data pointers: the planner's fake tensors have none)
        storage = storage_key(tensor)[0]
        return any(storage_key(b)[0] == storage for b in self.root.buffers())

    def pack(self, tensor: torch.Tensor) -> torch.Tensor | _Packed:
        """A block's boundary input: a host copy of it (counted), or itself where `_kept`."""
        if isinstance(tensor, nn.Parameter) or self._kept(tensor):
            return tensor
        self.packed_bytes += tensor.numel() * tensor.element_size()
        source = tensor.detach()
        if tensor.device.type != "cuda":
            return _Packed(torch.empty_like(source, device="cpu").copy_(source), tensor.device)
        if self._stream is None:
            self._stream = torch.cuda.Stream(tensor.device)
        host = torch.empty_like(source, device="cpu", pin_memory=True)
        # the side stream copies once the tensor is written; its memory is not reused before then
        self._stream.wait_stream(torch.cuda.current_stream(tensor.device))
        with torch.cuda.stream(self._stream):
            host.copy_(source, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self._stream)
        source.record_stream(self._stream)
        return _Packed(host, tensor.device, copied)

    @staticmethod
    def unpack(packed: torch.Tensor | _Packed) -> torch.Tensor:
        """What `pack` kept, on its device again: a copy (the recompute may write into it)."""
        if isinstance(packed, torch.Tensor):
            return packed
        if packed.copied is None:
            return packed.host.to(packed.device, copy=True)
        torch.cuda.current_stream(packed.device).wait_event(packed.copied)
        return packed.host.to(packed.device, non_blocking=True)


def offload_activations(model: nn.Module, blocks: list[str]) -> ActivationOffload:
    """Installs activation offload on ``model``'s checkpointed ``blocks`` (FQNs); returns its
    hooks' owner, which counts the bytes moved."""
    offload = ActivationOffload(model)
    offload.install([model.get_submodule(fqn) for fqn in blocks])
    return offload
