"""LoRA's settings (``model.lora``): which Linear modules get adapters, what else trains, and QLoRA's
frozen base in NF4 (docs/lora.md). A section of `fsdp_zero.config.schema`'s ``ModelConfig``."""

from __future__ import annotations

from dataclasses import dataclass, field

from fsdp_zero.config.checks import as_choice, check_positive, check_regexes
from fsdp_zero.config.choices import Quantize


@dataclass
class LoRAConfig:
    """LoRA (docs/lora.md): each targeted ``nn.Linear`` X computes ``W x + (alpha / rank) * B(A(dropout(x)))``
    with ``W`` frozen, ``A`` (rank x in) initialised as PEFT does and ``B`` (out x rank) zero; its
    adapters are ``X.lora_A.weight`` and ``X.lora_B.weight``. Everything else is frozen unless
    ``train`` names it."""

    rank: int = 0  # 0: off
    alpha: float = 16.0
    dropout: float = 0.0
    # The Linear modules to adapt: a last name component (q_proj) or a regex matching the full name.
    targets: list[str] = field(default_factory=list)
    # Regexes (full matches on parameter names) of more parameters to train: norms, the head.
    train: list[str] = field(default_factory=list)
    # QLoRA: nf4 stores the frozen base's Linear weights in 4-bit NormalFloat (`fsdp_zero.sharding.quantize`),
    # each quantized whole from model.pretrained's or model.init_from's tensor before it is sharded.
    quantize: Quantize = Quantize.none
    # The Linear modules whose weights nf4 quantizes (regexes, full matches on module names); empty:
    # every frozen Linear inside an FSDP unit other than the root (never the embeddings or the head).
    quantize_targets: list[str] = field(default_factory=list)
    nf4_block_size: int = 64  # elements per 4-bit block (one int8 scaler each)
    nf4_scaler_block_size: int = (
        256  # scalers per block of the double quantization (one factor each)
    )

    def check(self) -> None:
        if self.rank < 0:
            raise ValueError(f"model.lora.rank={self.rank}: must be >= 0 (0: LoRA off)")
        self.quantize = as_choice("model.lora.quantize", self.quantize, Quantize)
        if self.rank == 0:
            if self.quantize is not Quantize.none:
                raise ValueError(
                    f"model.lora.quantize={self.quantize.value} quantizes LoRA's frozen base, but "
                    "model.lora.rank=0 (LoRA off); set model.lora.rank and model.lora.targets"
                )
            for key in ("targets", "train", "quantize_targets"):
                if getattr(self, key):
                    raise ValueError(
                        f"model.lora.{key}={getattr(self, key)} is set but model.lora.rank=0 (LoRA "
                        "off); set model.lora.rank to a positive integer, e.g. 8"
                    )
            return
        if not self.targets:
            raise ValueError(
                f"model.lora.rank={self.rank} needs model.lora.targets, the Linear modules to "
                "adapt, e.g. 'model.lora.targets=[q_proj,v_proj]'"
            )
        check_positive("model.lora.alpha", self.alpha)
        if not 0 <= self.dropout < 1:
            raise ValueError(f"model.lora.dropout={self.dropout}: must be in [0, 1)")
        check_regexes("model.lora.targets", self.targets)
        check_regexes("model.lora.train", self.train)
        check_regexes("model.lora.quantize_targets", self.quantize_targets)
        check_positive("model.lora.nf4_block_size", self.nf4_block_size)
        check_positive("model.lora.nf4_scaler_block_size", self.nf4_scaler_block_size)
        if self.quantize_targets and self.quantize is Quantize.none:
            raise ValueError(
                f"model.lora.quantize_targets={self.quantize_targets} is set but "
                "model.lora.quantize=none; set model.lora.quantize=nf4"
            )
