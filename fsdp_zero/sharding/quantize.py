"""QLoRA's frozen base in NF4 (``model.lora.quantize=nf4``, docs/lora.md): which weights, the rules
they must fit, and the quantizer `fsdp_zero.sharding.parallelize.parallelize` runs on each FSDP unit
just before ``fully_shard`` shards it. The bytes of the low-bit AdamW states (``optim.state_bits``,
`adamw_state_bytes`), and which Linears float8 computes (``precision.float8``, `_float8_targets`).

    nf4 = plan_nf4(cfg.model, cfg.parallel.wrap, model, shards)  # which weights; blocks checked
    nf4.quantizer(model)  # what parallelize runs on each unit: its weights quantized, then sharded

Each weight is quantized whole, from the base's full tensor (``model.pretrained``'s or
``model.init_from``'s, read one tensor at a time), never from a rank's rows: NF4's double quantization
keeps one scaler mean per tensor, and FSDP2 rebuilds the gathered weight with the local shard's, so a
per-shard quantization gathers into another tensor (measured 7x the error, ../shared/research/lowbit.md
2.2). FSDP2 then chunks the NF4 tensor (its codes, scalers and factors) along dim 0: each shard must
be whole scaler blocks. No rank ever holds more than one full tensor of the base.

The quantized weights are not saved in checkpoints: every start rebuilds them from the same source,
bit-identical, and `NF4Base.digest` (recorded in train_state.json) proves it.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from fsdp_zero.config.choices import Quantize
from fsdp_zero.config.lora import LoRAConfig
from fsdp_zero.config.schema import ModelConfig, WrapConfig
from fsdp_zero.distributed.env import DistEnv
from fsdp_zero.model.source import FullWeights, base_source, match_weights
from fsdp_zero.sharding.wrap import WrapPlan, build_wrap_plan
from fsdp_zero.torch_private import convert_float8, precompute_float8_scales, to_nf4


def nf4_bytes(
    numel: int, block: int = 64, scaler_block: int = 256, itemsize: int = 4, shards: int = 1
) -> float:
    """Bytes one rank holds of an NF4 tensor of ``numel`` elements quantized from a tensor of
    ``itemsize``-byte elements and sharded ``shards`` ways: its codes (4 bits an element), scalers
    (one int8 per ``block``) and factors (one per ``block`` x ``scaler_block``) split, its scaler mean
    and 16-entry table whole on every rank. numel / 2 + numel / 64 + 4 numel / 16,384 + 68 for an
    fp32 source at the defaults: 0.5159 B per parameter (0.516, the formulas' figure).

    Args:
        numel: the tensor's elements.
        block: elements per 4-bit block (one int8 scaler each).
        scaler_block: scalers per block of scalers (one factor each).
        itemsize: bytes an element of the source tensor.
        shards: the ways the tensor is sharded.
    """
    return _nf4_gathered_bytes(numel, block, scaler_block, itemsize) / shards + 17 * itemsize


def _nf4_gathered_bytes(numel: int, block: int, scaler_block: int, itemsize: int) -> float:
    """Bytes one all-gather of an NF4 tensor produces: its codes, scalers and factors whole (FSDP2
    gathers them as bytes; the scaler mean and table travel as metadata)."""
    return numel / 2 + numel / block + itemsize * numel / (block * scaler_block)


# torchao's low-bit AdamW (optim.state_bits): values per scale block, and the smallest shard it
# quantizes (a shard under it, or not whole blocks, keeps fp32 states: bitsandbytes' rule)
STATE_BLOCK = {8: 256, 4: 128}
_STATE_MIN_NUMEL = 4096


def adamw_state_bytes(numel: int, bits: int) -> float:
    """Bytes of AdamW's two states for a shard of ``numel`` values at ``bits`` bits (32: torch's, 8
    B a value): each state ``bits`` / 8 B a value, one fp32 scale per block and its code table (256
    fp32 values at 8 bits, 16 at 4); 2.03 (8-bit) or 1.06 (4-bit) B a value for large shards."""
    block = STATE_BLOCK.get(bits)
    if block is None or numel < _STATE_MIN_NUMEL or numel % block:
        return 8 * numel
    return 2 * (numel * bits / 8 + 4 * numel / block + 4 * 2**bits)


def _default_targets(model: nn.Module, plan: WrapPlan) -> list[str]:
    """The Linear modules nf4 quantizes by default: each frozen, untied ``nn.Linear`` (LoRA's
    included) inside an FSDP unit other than the root: a block's projections, never the
    embeddings or the head, which live in the root unit."""
    units = [u.fqn for u in plan.units if u.fqn]
    tied = _tied(model)
    return [
        name
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear)
        and not m.weight.requires_grad
        and id(m.weight) not in tied
        and any(name.startswith(u + ".") for u in units)
    ]


def _tied(model: nn.Module) -> set[int]:
    seen: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        seen[id(p)] = seen.get(id(p), 0) + 1
    return {i for i, n in seen.items() if n > 1}


def _float8_targets(model: nn.Module, plan: WrapPlan, align: int = 16) -> list[str]:
    """The Linear modules precision.float8 converts: each ``nn.Linear`` inside an FSDP unit other than
    the root (a block's projections, never the head: torchtitan leaves the output in bf16) whose
    in and out features are multiples of ``align`` (float8 matmuls': 16, MXFP8's blocks: 32)."""
    units = [u.fqn for u in plan.units if u.fqn]
    return [
        name
        for name, m in model.named_modules()
        if type(m) is nn.Linear
        and m.in_features % align == 0
        and m.out_features % align == 0
        and any(name.startswith(u + ".") for u in units)
    ]


def chosen_targets(model: nn.Module, plan: WrapPlan, lora: LoRAConfig) -> list[str]:
    """``model.lora.quantize_targets``'s Linear modules (full-name regexes), else `_default_targets`.

    Raises:
        ValueError: a pattern that matches no Linear, or one whose weight trains or is tied.
    """
    if not lora.quantize_targets:
        return _default_targets(model, plan)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    tied, hits = _tied(model), set()
    for pattern in lora.quantize_targets:
        found = {n for n in linears if re.fullmatch(pattern, n)}
        if not found:
            shown = ", ".join(list(linears)[:8]) + (
                f", ... ({len(linears)} in all)" if len(linears) > 8 else ""
            )
            raise ValueError(
                f"model.lora.quantize_targets: {pattern!r} matches no nn.Linear (full match); the "
                f"model's Linear modules: {shown}"
            )
        for n in sorted(found):
            w = linears[n].weight
            if w.requires_grad or id(w) in tied:
                why = "trains" if w.requires_grad else "is tied to another module's"
                raise ValueError(
                    f"model.lora.quantize_targets: {n}.weight {why}; NF4 holds frozen, untied "
                    "weights only (drop it from the pattern)"
                )
        hits |= found
    return sorted(hits, key=list(linears).index)


def check_nf4(shapes: dict[str, torch.Size], shards: int, block: int, scaler_block: int) -> None:
    """Each weight to quantize fits NF4 sharded ``shards`` ways: whole scaler blocks per shard.

    Args:
        shapes: each weight's shape, by name.
        shards: the ways each is sharded.
        block: elements per 4-bit block.
        scaler_block: scalers per block of scalers.

    Raises:
        ValueError: one shard (FSDP2 cannot gather NF4 at one shard, pytorch PR #197999), or a weight
            that does not split into whole blocks, naming it and the fix.
    """
    if shards < 2:
        raise ValueError(
            f"model.lora.quantize=nf4 at a shard degree of {shards} (one rank, or a hybrid "
            "strategy's shard group of one) is not supported: FSDP2 cannot gather an NF4 weight "
            "it does not split (pytorch PR #197999); run 2 or more ranks per shard group"
        )
    unit = block * scaler_block
    for name, shape in shapes.items():
        numel = shape.numel()
        if shape[0] % shards or numel % (unit * shards):
            raise ValueError(
                f"model.lora.quantize=nf4: {name} {tuple(shape)} does not split into {shards} "
                f"shards of whole NF4 scaler blocks (dim 0 divisible by {shards}, and each shard "
                f"a multiple of model.lora.nf4_block_size x nf4_scaler_block_size = {block} x "
                f"{scaler_block} = {unit} elements); lower model.lora.nf4_scaler_block_size, or "
                "leave it unquantized with model.lora.quantize_targets"
            )


@dataclass
class NF4Base:
    """The quantized base of a QLoRA run: where its tensors come from and what they became.

    ``names``: {the model's parameter name: the source file's tensor name}; ``digest``: a CRC-32 of
    every NF4 tensor (codes, scalers, factors, in name order), filled in by the quantizer, the same at
    any world size; train_state.json records it and a resume checks it.
    """

    key: str  # model.pretrained or model.init_from
    source: str  # the weights file or folder read
    names: dict[str, str]
    block: int
    scaler_block: int
    dtype: str = "float32"  # the stored dtype each weight is cast to and quantized from
    digest: str = ""
    numel: int = 0  # parameters quantized
    rank_bytes: float = 0.0  # what one rank holds of them (`nf4_bytes` per tensor)
    gathered: dict[str, float] = field(default_factory=dict)  # `_nf4_gathered_bytes` per weight

    @classmethod
    def plan(
        cls,
        model: nn.Module,
        plan: WrapPlan,
        cfg: ModelConfig,
        shards: int,
        source: tuple[str, Path],
    ) -> NF4Base:
        """The weights of the meta-device ``model`` (LoRA applied) that nf4 quantizes, checked against
        NF4's blocks at ``shards`` and matched to ``source`` (its key and path).

        Args:
            model: the meta-device model, LoRA applied.
            plan: its FSDP units (the default targets are inside them).
            cfg: the model's settings (``model.lora``).
            shards: the ways each weight is sharded.
            source: the base's key (model.pretrained or model.init_from) and path.

        Raises:
            ValueError: see `chosen_targets`, `check_nf4`, and a source that does not fit the model.
        """
        lora = cfg.lora
        assert lora.quantize is Quantize.nf4
        weights = [f"{m}.weight" for m in chosen_targets(model, plan, lora)]
        params = dict(model.named_parameters())
        check_nf4(
            {n: params[n].shape for n in weights},
            shards,
            lora.nf4_block_size,
            lora.nf4_scaler_block_size,
        )
        key, path = source
        _, mapping, _ = match_weights(model, path, key)
        block, scaler_block = lora.nf4_block_size, lora.nf4_scaler_block_size
        return cls(
            key=key,
            source=str(path),
            names={n: mapping[n] for n in weights},
            block=block,
            scaler_block=scaler_block,
            dtype=str(params[weights[0]].dtype).removeprefix("torch.") if weights else "float32",
            numel=sum(params[n].numel() for n in weights),
            rank_bytes=sum(
                nf4_bytes(params[n].numel(), block, scaler_block, params[n].element_size(), shards)
                for n in weights
            ),
            gathered={
                n: _nf4_gathered_bytes(
                    params[n].numel(), block, scaler_block, params[n].element_size()
                )
                for n in weights
            },
        )

    def quantizer(self, model: nn.Module) -> Callable[[str, nn.Module], None]:
        """What `parallelize` calls with each FSDP unit (its FQN, '' the root) before sharding it:
        each of the unit's weights still on meta read whole, cast to its dtype, quantized and set
        as a frozen NF4 parameter; after the root, `digest` holds every tensor's."""
        source = FullWeights(Path(self.source), self.key)
        crcs: dict[str, int] = {}

        @torch.no_grad()
        def quantize(fqn: str, unit: nn.Module) -> None:
            for name, file_name in self.names.items():
                if fqn and not name.startswith(fqn + "."):
                    continue
                owner, _, attr = name.rpartition(".")
                module = model.get_submodule(owner)
                meta = getattr(module, attr)
                if not meta.is_meta:  # an inner unit's, already quantized and sharded
                    continue
                whole = source.rows(file_name, 0, meta.shape[0]).to(meta.dtype)
                nf4 = to_nf4(whole, self.block, self.scaler_block)
                del whole
                crcs[name] = _crc(nf4)
                setattr(module, attr, nn.Parameter(nf4, requires_grad=False))
            if not fqn:
                assert sorted(crcs) == sorted(self.names), "every quantized weight is in a unit"
                self.digest = _digest(crcs)

        return quantize

    def record(self) -> dict:
        """What train_state.json keeps (`fsdp_zero.checkpoint.dcp.TrainState.nf4_base`)."""
        out = asdict(self)
        out.pop("rank_bytes")  # this world size's
        out.pop("gathered")
        return out


@dataclass(frozen=True)
class Float8Plan:
    """precision.float8 as built: its recipe, whether it is emulated (no float8 units on the device),
    whether FSDP2 gathers the weights in float8 (tensorwise), and the converted weights' {name:
    values}."""

    recipe: str
    emulate: bool
    all_gather: bool
    weights: dict[str, int]

    def after_steps(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
        """tensorwise: every float8 weight's scale for the next all-gather computed after each
        optimizer step, in one all-reduce instead of one per weight (the same numbers)."""
        if self.all_gather:
            optimizer.register_step_post_hook(lambda *_: precompute_float8_scales(model))

    def after_load(self, model: nn.Module) -> None:
        """What follows a load into the built model (a checkpoint, model.init_from): tensorwise
        float8's precomputed scales recomputed from the loaded weights. (Loading a checkpoint
        creates the optimizer's states by a step with zero gradients, whose post-hook computed them
        from the weights before the load: the first step after a resume would gather with stale
        scales.)"""
        if self.all_gather:
            precompute_float8_scales(model)  # the loaded weights', not the last step's

    @property
    def gathered(self) -> dict[str, float]:
        """The weights FSDP2 gathers in float8, {name: bytes one gather moves} (1 B a value):
        tensorwise's; none with the other recipes (they gather in bf16)."""
        return dict(self.weights) if self.all_gather else {}

    def note(self) -> str:
        """The start-up line."""
        how = (
            "emulated (no float8 units on this device: real quantization, fp32 matmuls, no speed-up)"
            if self.emulate
            else "on the device's float8 units"
        )
        gather = (
            "weights all-gathered in float8" if self.all_gather else "weights all-gathered in bf16"
        )
        return (
            f"float8 {self.recipe} on {len(self.weights)} Linear modules ({sum(self.weights.values()):,} "
            f"weight values), {how}; {gather}"
        )


def plan_nf4(model_cfg: ModelConfig, wrap: WrapConfig, model: nn.Module, shards: int) -> NF4Base:
    """model.lora.quantize=nf4's base for the meta-device ``model`` (LoRA applied) at ``shards``,
    whose units ``wrap`` plans (`NF4Base.plan`).

    Args:
        model_cfg: the model's settings (``model.lora``, the base's ``model.pretrained`` or
            ``model.init_from``).
        wrap: the wrap settings (the default targets are inside the units).
        model: the meta-device model, LoRA applied.
        shards: the ways each weight is sharded.
    """
    plan = build_wrap_plan(model, wrap, shards)
    return NF4Base.plan(model, plan, model_cfg, shards, base_source(model_cfg))


def plan_float8(
    recipe: str,
    wrap: WrapConfig,
    model: nn.Module,
    env: DistEnv,
    shards: int,
    *,
    compiled: bool = False,
) -> Float8Plan:
    """precision.float8's ``recipe`` applied to the meta-device ``model``: `_float8_targets`
    converted (torchao).

    Args:
        recipe: tensorwise, rowwise or mxfp8 (precision.float8).
        wrap: the wrap settings (the converted Linears are inside the units).
        model: the meta-device model.
        env: the device (whether it has float8 units).
        shards: the shard degree the wrap plan is made for.
        compiled: whether the blocks are compiled (train.compile).

    Raises:
        ValueError: train.compile with emulated float8 (torchtitan's rule: emulation is eager-only).
    """
    cuda, mx = env.device.type == "cuda", recipe == "mxfp8"  # MXFP8's units: SM 10.0 (B200) on
    emulate = not (
        cuda and torch.cuda.get_device_capability(env.device) >= ((10, 0) if mx else (8, 9))
    )
    if emulate and compiled:
        raise ValueError(
            f"precision.float8={recipe} with train.compile=true: this device has no float8 units, and "
            "emulated float8 runs eager only; set train.compile=false"
        )
    plan = build_wrap_plan(model, wrap, shards)
    linears = _float8_targets(model, plan, 32 if mx else 16)
    weights = {f"{n}.weight": model.get_submodule(n).weight.numel() for n in linears}
    convert_float8(model, linears, recipe, emulate)
    return Float8Plan(recipe, emulate, recipe == "tensorwise", weights)


class RebuiltBase:
    """A QLoRA checkpoint's NF4 base, rebuilt from its recorded source for ``scripts/export.py``
    (`fsdp_zero.checkpoint.weights.export_checkpoint`'s ``rebuilt``): each weight read whole,
    quantized as in training and written dequantized (``original`` False: the function that was
    trained) or as read (``original`` True: the adapters then merge into the original weights).
    `verify` checks the digest of what was quantized against the recorded one."""

    def __init__(self, record: dict, original: bool) -> None:
        self.record, self.original = record, original
        self.dtype = getattr(torch, record.get("dtype", "float32"))
        try:
            self.source = FullWeights(Path(record["source"]), record["key"])
        except ValueError as e:
            raise ValueError(
                f"the QLoRA base this checkpoint was trained on cannot be read: {e}"
            ) from None
        names: dict[str, str] = record["names"]
        self.entries = {n: (self.dtype, self.source.shapes[f]) for n, f in names.items()}
        self.crcs: dict[str, int] = {}

    def read(self, name: str) -> torch.Tensor:
        file_name = self.record["names"][name]
        whole = self.source.rows(file_name, 0, self.entries[name][1][0]).to(self.dtype)
        nf4 = to_nf4(whole, self.record["block"], self.record["scaler_block"])
        self.crcs[name] = _crc(nf4)
        return whole if self.original else nf4.get_original_weight()

    def verify(self) -> None:
        """Raises a ValueError when every weight was read and their digest is not the recorded one."""
        if sorted(self.crcs) != sorted(self.record["names"]):
            return  # (an adapters-only export reads none of them)
        if _digest(self.crcs) != self.record["digest"]:
            raise ValueError(
                f"{self.record['key']}={self.record['source']!r} no longer holds the base this "
                f"checkpoint was trained on (NF4 digest {_digest(self.crcs)}, recorded "
                f"{self.record['digest']}); nothing was written"
            )


def _digest(crcs: dict[str, int]) -> str:
    total = 0
    for name in sorted(crcs):
        total = zlib.crc32(crcs[name].to_bytes(4, "little"), total)
    return f"{total:08x}"


def _crc(nf4: torch.Tensor) -> int:
    crc = 0
    for inner in (
        nf4.quantized_data,
        nf4.quantized_scalers,
        nf4.quantization_factor,
        nf4.scaler_mean,
    ):
        crc = zlib.crc32(inner.reshape(-1).contiguous().view(torch.uint8).numpy(), crc)
    return crc
