"""Full fine-tuning (AdamW states in 32, 8 and 4 bits) against LoRA and QLoRA on a Hugging Face Llama of
about 134M parameters, at N ranks.

    python bench/lora.py [--nproc-per-node 2] [--out DIR] [key=value ...]

Writes the model's initial weights once (`<out>/base.safetensors`, the base every run starts from:
`model.init_from`), then runs `scripts/train.py` five times under torchrun, each on fresh processes, on
the same model, data and batch: every parameter trained with torch's AdamW, then with torchao's 8-bit
and 4-bit AdamW states (`optim.state_bits`), LoRA on the attention's q_proj and v_proj (rank 16, alpha
32) with everything else frozen, and the same LoRA with every block Linear of the frozen base in NF4
(QLoRA, `model.lora.quantize=nf4`). Prints one markdown row each from the runs' summary.json:
trainable parameters, model state per rank against its formula (16 P / N for full fine-tuning, 4 + 4 +
2.03 or 1.06 B with low-bit states, 4 P_frozen / N + 16 P_trainable / N for LoRA, 0.516 B a parameter
for NF4's), peak RSS per rank, step time (the mean over the last log interval: after the low-bit runs'
compiled first step) and the final loss. The model is built from `model.kwargs` (GPT-2-small's
shape, Llama's blocks, untied head: 134M parameters), so no download is needed; `key=value` overrides
apply to every run (e.g. `train.steps=20`).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from fsdp_zero.tools import script_parser, train_command
from fsdp_zero.training import Summary

LLAMA_134M = (
    "model.target=transformers:LlamaForCausalLM",
    "model.kwargs.vocab_size=32000",
    "model.kwargs.hidden_size=768",
    "model.kwargs.intermediate_size=2048",
    "model.kwargs.num_hidden_layers=12",
    "model.kwargs.num_attention_heads=12",
    "model.kwargs.num_key_value_heads=12",
    "model.kwargs.max_position_embeddings=512",
    "model.kwargs.tie_word_embeddings=false",
)
COMMON = (
    "data.seq_len=256",
    "train.global_batch_size=2",
    "train.micro_batch_size=1",
    "train.steps=6",
    "train.log_every=2",
    "checkpoint.enabled=false",
    "memory.profile_step=0",
    "metrics.tensorboard=false",
)
LORA = ("model.lora.rank=16", "model.lora.alpha=32", "model.lora.targets=[q_proj,v_proj]")
RUNS = {
    "full fine-tuning, AdamW": (),
    "full fine-tuning, 8-bit states": ("optim.state_bits=8",),
    "full fine-tuning, 4-bit states": ("optim.state_bits=4",),
    "LoRA (q_proj, v_proj; rank 16)": LORA,
    "QLoRA (the same; block Linears in NF4)": (*LORA, "model.lora.quantize=nf4"),
}


def write_base(path: Path, overrides: list[str]) -> None:
    """The model's initial weights (the build's own initialisation for the run's seed), as safetensors."""
    from safetensors.torch import save_file

    from fsdp_zero.config import load_config
    from fsdp_zero.model import construct, real_buffers
    from fsdp_zero.sharding import materializer

    cfg = load_config(None, [*LLAMA_134M, *COMMON, *overrides])
    model = construct(cfg.model)
    materializer(torch.device("cpu"), cfg.model.init, cfg.train.seed, real_buffers(model), [])(
        model
    )
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))


def main(argv: list[str] | None = None) -> int:
    parser = script_parser(__doc__, nproc=2, out="lora-bench", overrides=True)
    args = parser.parse_args(argv)
    out = args.out
    rows = [
        "| run | trainable params | model state / rank (MiB) | formula (MiB) | peak RSS / rank (MiB) | step (s) "
        "| final loss |",
        "|---|---|---|---|---|---|---|",
    ]
    out.mkdir(parents=True, exist_ok=True)
    base = out / "base.safetensors"
    if not base.exists():
        write_base(base, args.overrides)
    for i, (name, extra) in enumerate(RUNS.items()):
        cmd = train_command(
            args.nproc_per_node,
            [
                *LLAMA_134M,
                *COMMON,
                f"model.init_from={base}",
                *extra,
                *args.overrides,
                f"run.root={out}",
                f"run.name=run{i}",
            ],
        )
        proc = subprocess.run(cmd)
        if proc.returncode:
            print(f"error: {name} exited {proc.returncode}", file=sys.stderr)
            return proc.returncode
        s = Summary.read(out / f"run{i}")
        ranks = s.ranks
        state = max(r["model_state_bytes"] for r in ranks) / 2**20
        peaks = ", ".join(format(r["peak_rss_mib"], ",.0f") for r in ranks)
        rows.append(
            f"| {name} | {s.num_params - s.num_frozen:,} of {s.num_params:,} | {state:,.1f} | "
            f"{s.model_state_formula_bytes / 2**20:,.1f} | {peaks} | {ranks[0]['step_s']:.3f} | "
            f"{s.final_loss:.4f} |"
        )
    table = "\n".join(rows) + "\n"
    (out / "lora-bench.md").write_text(table)
    print(
        f"\n## full fine-tuning (32-, 8-, 4-bit states) vs LoRA vs QLoRA, {args.nproc_per_node} ranks\n\n"
        f"{table}\nwrote {out / 'lora-bench.md'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
