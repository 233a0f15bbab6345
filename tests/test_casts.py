"""The inputs FSDP2 casts to the compute dtype without being asked, and the built-in model's rotary
table kept out of them: its blocks receive it as complex64 (FSDP2 casts only floating-point inputs),
so under bf16-mixed and fp16-mixed rotary computes with fp32 cos and sin, as in fp32. One rank of
gloo in this process; no training run.

Covers: fsdp_zero/monitor/casts.py, fsdp_zero/model/transformer.py
"""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from fsdp_zero.config.loader import load_config
from fsdp_zero.config.presets import model_args
from fsdp_zero.distributed.env import DistEnv
from fsdp_zero.model.transformer import Transformer, _apply_rotary
from fsdp_zero.monitor.casts import InputCast, input_casts
from fsdp_zero.sharding.build import build
from tests.batches import LLAMA, VIT
from tests.conftest import figure

NANO = ("model.preset=gpt_nano",)
BF16 = torch.bfloat16


def _built(env: DistEnv, *overrides: str) -> nn.Module:
    """The model ``overrides`` configure, sharded by the trainer's build (ZeRO-3, block units)."""
    config = None
    if overrides[:1] == ("--config",):
        config, overrides = overrides[1], overrides[2:]
    return build(load_config(config, list(overrides)), env, seed=0).model


def _fp32_rotary(x: torch.Tensor, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary by hand from x upcast to fp32, the table computed here in fp32: (the output, the
    norm of the pair each output element rotates, which rotation keeps)."""
    seq, head_dim = x.shape[-2], x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv_freq)
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x[..., : head_dim // 2].float(), x[..., head_dim // 2 :].float()
    out = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    return out, (x1 * x1 + x2 * x2).sqrt().repeat(1, 1, 1, 2)


# Rotary's error under the -mixed precisions against the fp32 reference, per element over the norm
# of its pair, in units of the compute dtype's unit roundoff u (bf16 2^-8, fp16 2^-11); gpt_nano,
# 4 x 256 tokens, q and k of both blocks. The table in fp32 (complex64): 0.97-1.00 u, the one
# rounding of the output (and bit for bit the fp32 reference rounded once). The table cast to the
# compute dtype (FSDP2's cast of the old real table; the `.to(x.dtype)` mutant): bf16 1.47-1.62 u,
# fp16 1.43-1.61 u. The bound sits between.
ROTARY_BOUND_U = 1.2


@pytest.mark.parametrize("mode", ["bf16-mixed", "fp16-mixed"])
def test_each_block_receives_the_rope_table_in_fp32_and_rotary_rounds_once(one_rank, mode):
    """Each block of a -mixed FSDP2 gpt_nano receives the table as complex64 holding the fp32
    buffer's bits; rotary of the q and k it computes is the fp32 reference rounded once."""
    model = _built(one_rank, *NANO, f"precision={mode}")
    compute = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}[mode]
    seen: dict[str, object] = {}
    # registered after fully_shard: each sees what FSDP2's pre-forward hands the block
    for name, block in model.layers.items():
        block.register_forward_pre_hook(lambda m, args, name=name: seen.__setitem__(name, args[1]))
        for w in ("wq", "wk"):
            getattr(block.attention, w).register_forward_hook(
                lambda m, args, out, key=f"{name}.{w}": seen.__setitem__(key, out)
            )
    torch.manual_seed(1)
    batch, seq = 4, 256
    with torch.no_grad():
        model(torch.randint(0, 256, (batch, seq)))
    head_dim = model.args.dim // model.args.n_heads
    u = torch.finfo(compute).eps / 2
    for name in model.layers:
        table = seen[name]
        assert table.dtype == torch.complex64, (name, table.dtype)
        assert torch.equal(torch.view_as_real(table), model.rope), name  # the fp32 buffer's bits
        for w in ("wq", "wk"):
            out = seen[f"{name}.{w}"]
            assert out.dtype == compute
            x = out.view(batch, seq, -1, head_dim).transpose(1, 2)  # as Attention.forward
            rotated = _apply_rotary(x, table)  # what the block computes from them
            reference, pair = _fp32_rotary(x)
            worst = ((rotated.float() - reference).abs() / pair.clamp_min(1e-30)).max() / u
            assert worst <= ROTARY_BOUND_U, (name, w, float(worst))
            assert torch.equal(rotated, reference.to(compute)), (name, w)


class _Scaled(nn.Module):
    """A unit that takes a table beside its activations, as the built-in blocks took the real
    rotary table."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        return self.proj(x) * table


def test_the_cast_finder_lists_what_fsdp_casts_per_unit_and_argument(one_rank):
    """Under bf16-mixed: the built-in GPT and a Hugging Face Llama pass their units nothing FSDP2
    casts; torchvision's ViT hands its root fp32 images (cast to bf16 before the patch convolution:
    activations, wanted); a unit given an fp32 table besides its bf16 activations has the table
    cast (what the GPT's blocks had before their table was complex)."""
    pytest.importorskip("transformers")
    pytest.importorskip("torchvision")
    found = {}
    start = time.perf_counter()
    gpt = _built(one_rank, *NANO, "precision=bf16-mixed")
    with input_casts(gpt) as found["gpt"]:
        gpt(torch.randint(0, 256, (2, 16)))
    llama = _built(one_rank, *LLAMA, "precision=bf16-mixed")
    with input_casts(llama) as found["llama"]:
        llama(torch.randint(0, 101, (2, 16)))
    vit = _built(one_rank, *VIT, "precision=bf16-mixed")
    with input_casts(vit) as found["vit"]:
        vit(torch.randn(2, 3, 32, 32))
    policy = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=torch.float32)
    outer = nn.ModuleDict({"unit": _Scaled()})
    fully_shard(outer["unit"], mp_policy=policy)
    with input_casts(outer) as found["table"]:
        outer["unit"](torch.randn(2, 8, dtype=BF16), torch.ones(8))
    assert found == {
        "gpt": [],
        "llama": [],
        "vit": [InputCast("", "args[0]", torch.float32, BF16)],
        "table": [InputCast("unit", "args[1]", torch.float32, BF16)],
    }
    with torch.no_grad():  # the hooks go with the context: nothing more is recorded
        vit(torch.randn(2, 3, 32, 32))
    assert len(found["vit"]) == 1
    figure("casts found (4 models)", f"{time.perf_counter() - start:.1f} s")


def test_a_block_traces_to_one_graph_without_breaks(one_rank):
    """torch.compile's per-block unit: dynamo traces a block with its complex64 table whole, plain
    and as an FSDP2 unit under bf16-mixed (seconds on CPU: tracing only, nothing compiled)."""
    block = Transformer(model_args("gpt_nano")).layers["0"]
    rope = torch.view_as_complex(Transformer(model_args("gpt_nano")).rope)[:32]  # its positions
    start = time.perf_counter()
    plain = torch._dynamo.explain(block)(torch.randn(2, 32, 64), rope)
    sharded = _built(one_rank, *NANO, "precision=bf16-mixed").layers["0"]
    torch._dynamo.reset()
    unit = torch._dynamo.explain(sharded)(torch.randn(2, 32, 64, dtype=BF16), rope)
    torch._dynamo.reset()
    for explained in (plain, unit):
        assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained
    figure(
        "dynamo explain of a gpt_nano block, plain and sharded",
        f"{time.perf_counter() - start:.1f} s",
    )
