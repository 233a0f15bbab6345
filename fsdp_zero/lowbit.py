"""Every torchao import (the ``lowbit`` extra): NF4 for QLoRA's frozen base (``model.lora.quantize``)
the low-bit AdamW states (``optim.state_bits``) and float8 compute (``precision.float8``).

torchao moves its APIs between releases (NF4 left ``torchao.dtypes.nf4tensor`` for
``torchao.quantization`` in 0.18), so this module is the one place that knows where they live. The core
never imports it unless a key that needs it is set: `fsdp_zero.sharding.quantize` imports it when
``model.lora.quantize`` is nf4, `fsdp_zero.sharding.build` when ``optim.state_bits`` is 8 or 4 or
``precision.float8`` is set.

NF4 (Dettmers et al. 2023, QLoRA): a tensor in blocks of ``block`` elements, each element a 4-bit code
into a 16-entry table scaled by its block's absolute maximum; the block scalers themselves quantized to
int8 in blocks of ``scaler_block``, with one factor per scaler block and one mean per tensor (double
quantization). ``F.linear`` on an `NF4Tensor` dequantizes it to its dtype and multiplies (torchao's
own ``__torch_function__``), in forward and in backward; FSDP2 shards and all-gathers it through its
``fsdp_pre_all_gather``/``fsdp_post_all_gather`` (the inner tensors, as bytes).
"""

from __future__ import annotations

try:
    import torchao  # noqa: F401
except ImportError as e:  # pragma: no cover - the extra is in dev, so the tests always have it
    raise ValueError(
        "model.lora.quantize=nf4 needs torchao: pip install 'fsdp-zero[lowbit]'"
    ) from e

import torch
from torch.distributed.tensor import DTensor

try:  # torchao >= 0.18
    from torchao.quantization import NF4Tensor, to_nf4
except ImportError:  # torchao 0.17
    from torchao.dtypes.nf4tensor import NF4Tensor, to_nf4

__all__ = [
    "NF4Tensor",
    "to_nf4",
    "is_nf4",
    "dequantize",
    "quantized_data",
    "low_bit_adamw",
    "convert_float8",
    "precompute_float8_scales",
]


def is_nf4(t: torch.Tensor) -> bool:
    """Whether ``t`` (or a DTensor's local shard) is NF4."""
    return isinstance(t.to_local() if isinstance(t, DTensor) else t, NF4Tensor)


def dequantize(t: torch.Tensor) -> torch.Tensor:
    """A whole (not sharded) NF4 tensor as a plain one in its dtype: the weight the forward computes with."""
    return t.get_original_weight()


def quantized_data(t: torch.Tensor) -> torch.Tensor:
    """The 4-bit codes of an NF4 tensor, two per byte (what a digest of the base reads)."""
    return t.quantized_data


def low_bit_adamw(bits: int) -> type[torch.optim.Optimizer]:
    """torchao's AdamW with ``bits``-bit states (8: AdamW8bit, blocks of 256; 4: AdamW4bit, blocks of
    128). Each parameter's update is a compiled function (``torch.compile(fullgraph=True,
    dynamic=False)``, one graph per shape): the caller turns AOTAutograd's cache off first
    (`fsdp_zero.torch_private.disable_autograd_cache`). Its learning rate is a tensor
    (`fsdp_zero.training.step.set_lr` fills it)."""
    from torchao.optim import AdamW4bit, AdamW8bit

    return {8: AdamW8bit, 4: AdamW4bit}[bits]


def convert_float8(model: torch.nn.Module, linears: list[str], recipe: str, emulate: bool) -> None:
    """Swaps each of ``model``'s ``linears`` (FQNs of ``nn.Linear`` modules, on the meta device before
    sharding, as torchtitan does) for torchao's ``Float8Linear`` (the same weight and bias, so names and
    checkpoints do not change): its three matmuls in float8 with dynamic scales, per tensor
    (``tensorwise``: the weight also all-gathered by FSDP2 in float8) or per row (``rowwise``: gathered
    in bf16). ``emulate``: quantize for real but multiply in fp32 (a device without float8 units)."""
    import dataclasses

    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    if recipe == "tensorwise":
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=True, emulate=emulate)
    else:
        config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=emulate)
    chosen = set(linears)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn: fqn in chosen)


def precompute_float8_scales(model: torch.nn.Module) -> None:
    """tensorwise: every float8 weight's scale (its absolute maximum) for the next all-gather, in one
    all-reduce after the optimizer step instead of one per weight (the same numbers)."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)
