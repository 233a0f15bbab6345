"""Continue a DeepSpeed run here: its checkpoint becomes a fsdp-zero checkpoint in a new run directory.

    python scripts/import_deepspeed.py DS_CHECKPOINT --run-dir runs/continued \\
        [--deepspeed ds_config.json] [--config X.yaml] [--rename OLD=NEW ...] [key=value ...]
    torchrun --nproc_per_node=N scripts/train.py --deepspeed ds_config.json [--config X.yaml] \\
        run.root=runs run.name=continued [key=value ...]

DS_CHECKPOINT is the folder ``engine.save_checkpoint`` wrote (holding ``latest``), one
``global_stepK`` folder of it, or its universal form (``ds_to_universal``), of ZeRO-1, -2 or -3 at any
number of ranks. The settings are train.py's, in its order (defaults, --config, --deepspeed, then
key=value; without --deepspeed, the ds_config the checkpoint saved): give train.py the same ones.
The run directory gets checkpoint K (DeepSpeed's global step): the fp32 weights, AdamW's moments and
step for each parameter, and the data position DeepSpeed reached (its global samples); its
config.yaml records whether DeepSpeed's optimizer decayed the 1-D parameters (``optim.decay_1d``,
read from the checkpoint's parameter groups; a warning when the settings said otherwise); train.py
continues with step K + 1 at the learning rate DeepSpeed's scheduler had set for it, at any world
size. ``--rename OLD=NEW`` replaces a prefix of DeepSpeed's parameter names (e.g. ``--rename
model.=`` for a model that DeepSpeed saw inside a wrapper). Needs no DeepSpeed, no GPU and no
torch.distributed, and holds the model's fp32 weights and both moments in memory (12 bytes a parameter).

A bad setting, a checkpoint that does not fit the model, a truncated file or one that pickles a
foreign class: one line, exit 2, nothing written. docs/deepspeed.md, "Coming from DeepSpeed".
"""

from __future__ import annotations

import math
import sys
from dataclasses import replace
from pathlib import Path

from fsdp_zero.checkpoint import (
    TrainState,
    from_deepspeed,
    read_deepspeed_checkpoint,
    write_imported,
)
from fsdp_zero.config import load_config, read_deepspeed, to_yaml
from fsdp_zero.distributed import draw_seed
from fsdp_zero.model import construct
from fsdp_zero.tools import script_parser
from fsdp_zero.training import lr_factor


def _renames(pairs: list[str]) -> list[tuple[str, str]]:
    out = []
    for pair in pairs:
        old, eq, new = pair.partition("=")
        if not eq:
            raise ValueError(
                f"--rename {pair!r}: expected OLD=NEW (a name prefix and its replacement; "
                "OLD empty: NEW is put before every name)"
            )
        out.append((old, new))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = script_parser(__doc__)
    parser.add_argument("checkpoint", type=Path, help="a DeepSpeed checkpoint folder")
    parser.add_argument("--run-dir", type=Path, required=True, help="a new run directory")
    parser.add_argument("--config", help="YAML file of settings, as for train.py")
    parser.add_argument("--deepspeed", metavar="JSON", help="the run's ds_config.json")
    parser.add_argument(
        "--rename", action="append", default=[], metavar="OLD=NEW", help="a parameter name prefix"
    )
    parser.add_argument("overrides", nargs="*", help="key=value settings, as for train.py")
    args = parser.parse_intermixed_args(argv)
    try:
        renames = _renames(args.rename)
        ckpt = read_deepspeed_checkpoint(args.checkpoint)
        mapped, _ = read_deepspeed(args.deepspeed or ckpt.ds_config, ckpt.world_size)
        run = [f"run.root={args.run_dir.parent}", f"run.name={args.run_dir.name}"]
        cfg = load_config(args.config, mapped + args.overrides + run)
        if cfg.model.lora.rank or cfg.model.freeze:
            raise ValueError(
                "model.lora / model.freeze: a DeepSpeed checkpoint is imported with every "
                "parameter trained (valid: model.lora.rank=0, model.freeze=[])"
            )
        if cfg.train.seed is None:
            cfg = replace(cfg, train=replace(cfg.train, seed=draw_seed()))
        # (optim.decay_1d as DeepSpeed's optimizer ran, recorded in config.yaml)
        state, optim, notes = from_deepspeed(ckpt, construct(cfg.model), cfg.optim, renames)
        cfg = replace(cfg, optim=optim)
        ours = cfg.optim.lr * lr_factor(ckpt.step, cfg.optim, cfg.train.steps)
        theirs = next(iter(ckpt.params.values())).lr
        if not math.isclose(ours, theirs, rel_tol=1e-9):
            notes.append(
                f"warning: DeepSpeed's scheduler set lr {theirs:.6g} for step {ckpt.step + 1}; this "
                f"config gives {ours:.6g} (pass the run's own ds_config.json, or set optim.* to match)"
            )
        origin = {"folder": str(ckpt.folder), "form": ckpt.form, "deepspeed": ckpt.version}
        train_state = TrainState(
            step=ckpt.step,
            data_position=ckpt.samples,
            world_size=ckpt.world_size,
            origin=origin,
        )
        written = write_imported(args.run_dir, state, train_state, to_yaml(cfg))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for note in notes:
        print(note, file=sys.stderr)
    numel = sum(t.numel() for t in state["model"].values())
    print(
        f"{written}: DeepSpeed {ckpt.version} {ckpt.form} checkpoint of {ckpt.world_size} ranks, "
        f"step {ckpt.step}, {ckpt.samples:,} samples; {len(state['model'])} tensors "
        f"({numel:,} values) with AdamW's moments for {len(state['optim'])}; step {ckpt.step + 1} "
        f"runs at lr {ours:.6g} (DeepSpeed's: {theirs:.6g})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
