"""Pipeline parallelism (draft, not wired in yet): each rank keeps only its stage of the meta-device
model, under the full model's parameter names; torch.distributed.pipelining's schedules run the
micro-batches (see dev/pp_proto.py for the parity prototype)."""

from __future__ import annotations

from torch import nn


def stage_layers(n_layers: int, num_stages: int) -> list[range]:
    """Contiguous, balanced ranges of layer indices, one per stage (the first stages take the
    remainder)."""
    per, extra = divmod(n_layers, num_stages)
    out, start = [], 0
    for s in range(num_stages):
        stop = start + per + (1 if s < extra else 0)
        out.append(range(start, stop))
        start = stop
    return out


def keep_stage(model: nn.Module, stage: int, num_stages: int) -> nn.Module:
    """``model`` (the built-in Transformer, on meta) cut to pipeline stage ``stage`` in place: its
    layers only, the embedding on the first stage, the final norm and head on the last."""
    keep = {str(i) for i in stage_layers(len(model.layers), num_stages)[stage]}
    for name in [n for n in model.layers if n not in keep]:
        del model.layers[name]
    if stage != 0:
        model.tok_embeddings = None
    if stage != num_stages - 1:
        model.norm = model.output = None
    return model
