"""Precision: the dtype each part of the model state is stored, computed, reduced and exported in.

| mode        | stored (sharded) | gathered, computed | gradients reduced | AdamW states | bytes/param (w+g+k) |
|-------------|------------------|--------------------|-------------------|--------------|---------------------|
| fp32        | fp32             | fp32               | fp32              | fp32         | 4 + 4 + 8 = 16      |
| bf16-mixed  | fp32 (master)    | bf16               | fp32              | fp32         | 4 + 4 + 8 = 16      |
| fp16-mixed  | fp32 (master)    | fp16, loss-scaled  | fp32              | fp32         | 4 + 4 + 8 = 16      |
| bf16-true   | bf16             | bf16               | bf16              | bf16         | 2 + 2 + 4 = 8       |

The ``-mixed`` modes are FSDP2's `MixedPrecisionPolicy`: each unit's parameters are cast as they
are all-gathered, so the low-precision copy exists only while a unit is gathered (its bytes are in
the activation-side peak, not in the model state). DeepSpeed's mixed-precision ZeRO-3 holds the
same 16 bytes per parameter in another split (2 fp16 weights + 2 fp16 gradients + 12 fp32 master
weights and moments); AdamW's states here follow the stored parameters, so they are fp32 whenever
the stored weights are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from fsdp_zero.config.schema import PrecisionConfig

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}


@dataclass(frozen=True)
class Precision:
    mode: str
    # sharded parameters (the optimizer's weights), their gradients, AdamW's states
    stored: torch.dtype
    compute: torch.dtype  # each unit's gathered parameters in forward and backward
    reduce: torch.dtype  # gradients as they are reduce-scattered (or all-reduced)

    @property
    def loss_scaling(self) -> bool:
        """fp16 gradients underflow without a loss scale."""
        return torch.float16 in (self.compute, self.reduce, self.stored)

    @property
    def bytes_per_param(self) -> tuple[int, int, int]:
        """(weights, gradients, optimizer states) bytes per parameter: AdamW keeps two moments."""
        s = self.stored.itemsize
        return s, s, 2 * s

    def mp_policy(self) -> MixedPrecisionPolicy:
        """FSDP2's policy: cast to ``compute`` when gathering, reduce in ``reduce``. Every
        floating-point input of each unit is cast to ``compute`` too (``cast_forward_inputs``),
        complex ones are not: a unit that computes with an fp32 table takes it as complex64, as the
        built-in model's blocks take their rotary table (`fsdp_zero.monitor.casts.input_casts`
        lists what a model's units have cast). The default policy when nothing differs."""
        if self.compute == self.stored and self.reduce == self.stored:
            return MixedPrecisionPolicy()
        return MixedPrecisionPolicy(param_dtype=self.compute, reduce_dtype=self.reduce)

    def manifest(self, num_params: int, state_bytes: float, where: str) -> str:
        """What rank 0 prints at start-up: each dtype and its bytes per parameter, and the model state
        per rank (``state_bytes``, from the strategy's formula with these bytes; ``where``: e.g. '/ N=2')."""
        w, g, k = self.bytes_per_param
        n = DTYPE_NAMES
        return (
            f"precision {self.mode}: stored weights {n[self.stored]} ({w} B/param) | computed in "
            f"{n[self.compute]} ({self.compute.itemsize} B/param, only while a unit is gathered) | "
            f"gradients {n[self.stored]} ({g} B/param), reduced in {n[self.reduce]} | AdamW states "
            f"{n[self.stored]} x 2 ({k} B/param) | checkpoints and export {n[self.stored]} | model "
            f"state {w + g + k} B x {num_params:,} params {where} = {state_bytes / 2**20:,.2f} MiB "
            "per rank" + (" | fp16 loss scaling on" if self.loss_scaling else "")
        )


def resolve_precision(cfg: PrecisionConfig) -> Precision:
    """The dtypes ``precision.mode`` stands for, with ``param_dtype``/``reduce_dtype`` overriding
    the computed and reduced ones."""
    stored = torch.bfloat16 if cfg.mode == "bf16-true" else torch.float32
    compute = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}.get(cfg.mode, stored)
    if cfg.param_dtype is not None:
        compute = _DTYPES[cfg.param_dtype]
    reduce = stored if cfg.reduce_dtype is None else _DTYPES[cfg.reduce_dtype]
    return Precision(cfg.mode, stored, compute, reduce)


class LossScaler(torch.amp.GradScaler):
    """torch's GradScaler (it works on sharded DTensor gradients: an inf or NaN on any rank makes
    every rank skip the step, the found-inf flag being reduced over the mesh), plus a count of the
    steps it skipped; both are saved with checkpoints."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.skipped_steps = torch.zeros(())

    def count(self, grad_norm: torch.Tensor) -> None:
        """After a step: a non-finite global norm means the scaler found an overflow and skipped it."""
        self.skipped_steps = self.skipped_steps + (~torch.isfinite(grad_norm)).float().cpu()

    def scalars(self) -> dict[str, torch.Tensor]:
        return {"loss_scale": torch.tensor(self.get_scale()), "skipped_steps": self.skipped_steps}

    def state_dict(self) -> dict:
        return super().state_dict() | {"skipped_steps": int(self.skipped_steps)}

    def load_state_dict(self, state: dict) -> None:
        state = dict(state)
        self.skipped_steps = torch.tensor(float(state.pop("skipped_steps", 0)))
        super().load_state_dict(state)


def loss_scaler(
    cfg: PrecisionConfig, precision: Precision, device: torch.device
) -> LossScaler | None:
    """A loss scaler for fp16 (None otherwise), from DeepSpeed's settings (see PrecisionConfig)."""
    if not precision.loss_scaling:
        return None
    if cfg.loss_scale > 0:  # fixed: never grows, never shrinks
        return LossScaler(
            device.type,
            init_scale=cfg.loss_scale,
            growth_factor=1.0,
            backoff_factor=1.0,
            growth_interval=2**31 - 1,
        )
    return LossScaler(
        device.type, init_scale=2.0**cfg.initial_scale_power, growth_interval=cfg.loss_scale_window
    )
