"""fsdp-zero: ZeRO-3 memory savings with plain PyTorch FSDP2, torchrun and omegaconf."""

__version__ = "0.1.0"
