"""Tokenize text, JSONL, Parquet, Arrow or CSV with a Hugging Face tokenizer into the token files
data.source=tokens reads.

    python scripts/prepare_data.py --tokenizer MODEL_DIR --input corpus/ [more.parquet ...] --out data/mine \\
        [--val-fraction 0.05] [--field text] [--workers 4] [--seed 0] \\
        [--format text|prompt_completion|chat] [--prompt-field prompt] [--completion-field completion]

Each .txt file is one document, each line of a .jsonl file one (its text in --field), and each row
of a .parquet, .arrow or .csv file or of a folder that datasets' save_to_disk wrote one (its text in
the column --field); other folders are read recursively in sorted order. Tables are read through
Hugging Face datasets (the `hf` extra), streamed a batch of rows at a time: memory does not grow with
the input. Writes OUT/train.bin, OUT/val.bin and OUT/meta.json (see fsdp_zero.data.prepare); train
with data.source=tokens data.path=OUT/train.bin. The output is the same, byte for byte, for any
--workers, and for the same records in any of those kinds of file. Needs the `hf` extra
(transformers; datasets for tables). A bar with documents/s and tokens/s shows on a terminal
(stderr). docs/fine-tuning.md#input-formats has the details.

--format prompt_completion reads records with a prompt and a completion (JSONL fields or table
columns: --prompt-field, --completion-field); --format chat records with a list of messages
(--field, default messages; not from CSV, whose cells hold no lists), rendered by the tokenizer's
chat template. Both write OUT/train.mask.bin and OUT/val.mask.bin beside the token files (one byte
a token, 1 where it is trained on: the completion, or the assistant turns, and the EOS after
them), which data.source=tokens and eval.path read: the loss leaves the other tokens out.
"""

from __future__ import annotations

import argparse
import sys
import time

from fsdp_zero.data import DEFAULT_VAL_FRACTION, Fields, prepare
from fsdp_zero.tools import script_parser


def parser() -> argparse.ArgumentParser:
    """prepare_data.py's command line."""
    parser = script_parser(__doc__)
    parser.add_argument(
        "--tokenizer",
        required=True,
        help="a folder that save_pretrained wrote (a model folder will do)",
    )
    parser.add_argument(
        "--input",
        nargs="+",
        required=True,
        help=".txt, .jsonl, .parquet, .arrow or .csv files, save_to_disk folders, or folders of them",
    )
    parser.add_argument(
        "--out", required=True, help="a new folder for train.bin, val.bin and meta.json"
    )
    parser.add_argument(
        "--val-fraction",
        type=float,
        default=DEFAULT_VAL_FRACTION,
        help=f"the share of documents held out for validation (default {DEFAULT_VAL_FRACTION})",
    )
    parser.add_argument(
        "--field",
        default=None,
        help="the JSONL field or table column that holds the text (default: text; --format chat: "
        "messages)",
    )
    parser.add_argument(
        "--format",
        default="text",
        choices=("text", "prompt_completion", "chat"),
        help="text: documents (default); prompt_completion or chat: instruction records, masked",
    )
    parser.add_argument(
        "--prompt-field",
        default="prompt",
        help="--format prompt_completion: the prompt's field (column)",
    )
    parser.add_argument(
        "--completion-field",
        default="completion",
        help="--format prompt_completion: the completion's field (column)",
    )
    parser.add_argument(
        "--workers", type=int, default=1, help="tokenizing processes (default 1: this one)"
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="chooses the validation documents (default 0)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    start = time.perf_counter()
    try:
        fields = Fields(args.format, args.field, args.prompt_field, args.completion_field)
        meta, seconds = prepare(
            args.tokenizer, args.input, args.out, fields, args.val_fraction, args.workers, args.seed
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    tokens = meta["train"]["tokens"] + meta["val"]["tokens"]
    for split in ("train", "val"):
        print(
            f"{args.out}/{split}.bin: {meta[split]['documents']:,} documents, {meta[split]['tokens']:,} tokens "
            f"({meta['dtype']})"
            + (f", {meta[split]['trained_tokens']:,} trained on" if args.format != "text" else "")
        )
    print(
        f"{tokens:,} tokens at {tokens / seconds:,.0f} tokens/s ({args.workers} worker(s); {seconds:.1f} s "
        f"tokenizing, {time.perf_counter() - start:.1f} s in all); vocabulary {meta['vocab_size']:,}, "
        f"EOS id {meta['eos_id']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
