"""Consolidate a sharded checkpoint's model weights into safetensors, streaming.

    python scripts/export.py runs/NAME/checkpoints/step-0000150 --out exported/ [--dtype bf16] [--max-shard-size 2GB]

Needs no GPU and no torch.distributed; holds about one tensor in memory at a time.
A Hugging Face model (model.pretrained, or a model.target class with a config_class) exported
into a folder is a from_pretrained folder: config.json (its class in architectures, the exported
dtype), and the generation config and tokenizer files the run copied from model.pretrained.
Otherwise (or with --weights-only) the weights load with a plain
`model.load_state_dict(safetensors.torch.load_file(...))` (or, for shards, file by file following
model.safetensors.index.json).

A LoRA run (model.lora) is merged by default: each adapted weight becomes W + alpha/rank x B A and
the adapter keys are dropped, a plain model (for a Hugging Face model its from_pretrained folder, in
which only the adapted weights differ from the base). ``--adapters-only`` writes the adapters alone
with PEFT's names, adapter_model.safetensors and adapter_config.json, for
``peft.PeftModel.from_pretrained(base, out)``. A QLoRA run (model.lora.quantize=nf4) keeps its base
out of its checkpoints: the export reads it again from the recorded file and merges into the
dequantized NF4 weights the adapters were trained on (``--merge-into original``: into the file's own).
"""

from __future__ import annotations

import sys
from pathlib import Path

from fsdp_zero.checkpoint import EXPORT_DTYPES, MERGE_INTO, export
from fsdp_zero.monitor import parse_size
from fsdp_zero.tools import script_parser


def main(argv: list[str] | None = None) -> int:
    parser = script_parser(__doc__)
    parser.add_argument(
        "checkpoint", type=Path, help="a checkpoint folder (…/checkpoints/step-NNNNNNN)"
    )
    parser.add_argument(
        "--out", type=Path, required=True, help="a new folder, or a .safetensors file"
    )
    parser.add_argument(
        "--dtype",
        choices=sorted(EXPORT_DTYPES),
        help="cast floating-point weights (default: as saved)",
    )
    parser.add_argument(
        "--max-shard-size",
        help="split into files of at most this size, e.g. 2GB (default: one file)",
    )
    parser.add_argument(
        "--weights-only",
        action="store_true",
        help="only the safetensors, even for a Hugging Face model (no config.json, no tokenizer)",
    )
    parser.add_argument(
        "--adapters-only",
        action="store_true",
        help="a LoRA run: only the adapters, as PEFT's adapter_model.safetensors and adapter_config.json",
    )
    parser.add_argument(
        "--merge-into",
        choices=MERGE_INTO,
        default="trained",
        help="a QLoRA run (model.lora.quantize=nf4): merge the adapters into the dequantized NF4 base "
        "they were trained on (trained, the default) or into the original weights",
    )
    args = parser.parse_args(argv)
    try:
        limit = parse_size(args.max_shard_size, "--max-shard-size") if args.max_shard_size else None
        exported = export(
            args.checkpoint,
            args.out,
            dtype=EXPORT_DTYPES.get(args.dtype),
            max_shard_bytes=limit,
            weights_only=args.weights_only,
            adapters_only=args.adapters_only,
            merge_into=args.merge_into,
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if exported.note:
        print(f"note: no config.json: {exported.note}; the weights only", file=sys.stderr)
    for f in exported.files:
        print(f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
