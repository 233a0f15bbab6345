"""Ulysses sequence parallelism (fsdp_zero/sharding/sequence.py, ``parallel.sp_size``).

The numbers against one process on the whole sequence are tests/test_parity.py's (sp2: dp 1 x sp 2;
sp4: sp 4 with every block checkpointed; hsdp-sp2: two replicas of an sp 2 shard group),
tests/test_models.py's (llama-sp2: a Hugging Face Llama through fsdp-zero's attention function),
tests/test_masked.py's (masked-sp2: the trained tokens counted over dp 2 x sp 2) and
tests/test_checkpoint.py's (a checkpoint moved into sp 4 and out of sp 2). Here: what the ranks
send, what each holds, and the refusals.

Covers: fsdp_zero/sharding/sequence.py, fsdp_zero/distributed/topology.py,
    fsdp_zero/monitor/comm.py, fsdp_zero/data/loader.py
"""

from __future__ import annotations

import json

import pytest
import torch

from fsdp_zero.config import RunDir
from fsdp_zero.config.loader import load_config
from fsdp_zero.config.schema import ParallelConfig
from fsdp_zero.data.loader import sequence_part
from fsdp_zero.distributed.topology import Role, Topology
from fsdp_zero.monitor.memory import MIB
from fsdp_zero.sharding.sequence import check_heads, layer_bytes
from tests.batches import BASE
from tests.conftest import REPO, figure, run_script
from tests.hf_fixtures import LLAMA_CONFIG

HAS_HF = __import__("importlib").util.find_spec("transformers") is not None


def _summary(batches, name: str) -> tuple[dict, list[dict]]:  # noqa: ANN001
    path = batches.path(name)
    rows = [r for r in RunDir(path).metric_rows() if "loss" in r]
    return json.loads((path / "summary.json").read_text()), rows


# gpt_nano (dim 64 = 4 heads x 16, 2 blocks), sequences of 32, micro-batches of 2, fp32; a global
# batch of 8 over 1 data-parallel rank: 4 micro-batches a step; sp4 recomputes both blocks
SP_RUNS = {"sp2": (2, 0), "sp4": (4, 2)}  # name: (sp, blocks recomputed)


@pytest.mark.parametrize("name", list(SP_RUNS))
def test_each_layer_sends_4_slice_h_b_over_sp_and_attention_gathers_nothing(batches, name):
    """The all-to-all bytes each rank sends per attention layer and direction are 4 (S / sp) h b
    (sp - 1) / sp for each sequence (q, k, v and the output), by hand; a step sends them forward,
    backward and once more for each recomputed block, on every rank and every step. The
    all-gathers are FSDP's units' alone (the formula's, with no term for attention): attention
    gathers no sequence."""
    sp, recomputed = SP_RUNS[name]
    summary, rows = _summary(batches, name)
    per_layer = 4 * (32 // sp) * 64 * 2 * 4 * (sp - 1) / sp  # a micro-batch of 2 sequences
    assert per_layer == layer_bytes(
        tokens=2 * 32, heads=4, kv_heads=4, head_dim=16, itemsize=4, size=sp
    )
    step = 4 * per_layer * (2 * 2 + recomputed)
    assert summary["comm_formula_bytes"]["sp_all_to_all"] == step
    for rank in summary["ranks"]:
        assert rank["comm_bytes"]["sp_all_to_all"] == step
        assert rank["comm_bytes"]["all_gather"] == summary["comm_formula_bytes"]["all_gather"]
    assert len(rows) == summary["steps"]
    for row in rows:
        assert row["comm/sp_all_to_all_mib"] * MIB == pytest.approx(step, rel=1e-12), row["step"]
    figure(
        f"{name}: all-to-all bytes per layer and direction",
        f"{per_layer:,.0f} B a micro-batch (4 (S/sp) h b (sp-1)/sp), {step / MIB:.3f} MiB a step",
    )


def test_the_model_state_is_divided_by_every_rank_of_the_group(batches):
    """ALST's layout: the sequence-parallel ranks shard the model (FSDP's mesh is dp_shard x sp), so
    at dp 1 x sp 4 each rank holds what ZeRO-3 at 4 ranks holds, byte for byte, 16 P / 4 (and
    FSDP2's padding of each tensor to 4 rows)."""
    sp4, _ = _summary(batches, "sp4")
    n4, _ = _summary(batches, "n4")
    assert [r["model_state_bytes"] for r in sp4["ranks"]] == [
        r["model_state_bytes"] for r in n4["ranks"]
    ]
    params = sum(v.numel() for v in batches["sp4"]["initial"].values())
    assert sp4["ranks"][0]["model_state_formula_bytes"] == 16 * params / 4


@pytest.mark.parametrize(
    "overrides, world, sizes, shard",
    [
        ({"sp_size": 2}, 4, {"dp_replicate": 1, "dp_shard": 2, "sp": 2}, 4),
        ({"sp_size": 4}, 4, {"dp_replicate": 1, "dp_shard": 1, "sp": 4}, 4),
        (
            {"sp_size": 2, "strategy": "hybrid_shard", "shard_size": 4},
            8,
            {"dp_replicate": 2, "dp_shard": 2, "sp": 2},
            4,
        ),
    ],
)
def test_the_sequence_axis_joins_the_shard_group_and_the_loss_not_the_batch(
    overrides, world, sizes, shard
):
    """The grid: sp sits inside the data-parallel axes; FSDP shards over dp_shard x sp (hybrid:
    shard_size counts them), the loss's sums span sp, the batch's ranks do not (a group reads one
    batch and each takes its slice)."""
    topology = Topology.of(ParallelConfig(**overrides), world)
    assert {a: topology.sizes[a] for a in sizes} == sizes
    assert topology.shard_group == topology.param_shards == shard
    assert "sp" in topology.axes(Role.SHARD) and "sp" in topology.axes(Role.LOSS)
    assert "sp" not in topology.axes(Role.BATCH)
    ranks = range(world)
    assert [topology.rank("sp", r) for r in ranks] == [
        r % 2 if sizes["sp"] == 2 else r % 4 for r in ranks
    ]
    # the ranks of one group read one batch
    assert len({topology.rank(Role.BATCH, r) for r in ranks}) == world // sizes["sp"]


def test_each_rank_takes_its_slice_of_the_inputs_and_the_shifted_targets():
    tokens = torch.arange(2 * 13).view(2, 13)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]  # shifted before the cut, as the sources do
    parts = [sequence_part((inputs, targets), r, 3) for r in range(3)]
    assert [p[0].shape for p in parts] == [torch.Size([2, 4])] * 3
    assert torch.equal(torch.cat([p[0] for p in parts], dim=1), inputs)
    for x, y in parts:  # each slice's targets are its inputs' next tokens, the last one included
        assert torch.equal(y, x + 1)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["parallel.sp_size=3"], r"parallel\.sp_size=3 must divide data\.seq_len=32"),
        (
            ["parallel.sp_size=8", "data.seq_len=64"],
            r"model\.n_heads=4 must be a multiple of parallel\.sp_size=8",
        ),
        (
            ["parallel.sp_size=2", "model.n_kv_heads=1"],
            r"model\.n_kv_heads=1 must be a multiple of parallel\.sp_size=2",
        ),
        (
            ["parallel.sp_size=2", "parallel.strategy=hybrid_shard", "parallel.shard_size=1"],
            None,  # at the world size: Topology.of
        ),
    ],
)
def test_cuts_that_do_not_divide_are_one_line(overrides, message):
    if message is None:
        cfg = load_config(None, [*BASE, *overrides])
        with pytest.raises(
            ValueError,
            match=r"^parallel\.shard_size=1 must divide the 4 ranks FSDP "
            r"shards over and be a multiple of parallel\.sp_size=2; valid choices: \[2, 4\]$",
        ):
            Topology.of(cfg.parallel, 4)
        return
    with pytest.raises(ValueError, match=message):
        load_config(None, [*BASE, *overrides])


@pytest.mark.skipif(not HAS_HF, reason="needs transformers")
def test_a_hugging_face_model_whose_heads_do_not_divide_is_one_line():
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):  # 4 heads, 2 key-value heads
        model = LlamaForCausalLM(LlamaConfig(**LLAMA_CONFIG))
    check_heads(model, 2)
    with pytest.raises(
        ValueError,
        match=r"^parallel\.sp_size=4 must divide the model's num_key_value_heads=2 \(each rank "
        r"attends with a share of them\); valid choices: \[1, 2\]$",
    ):
        check_heads(model, 4)


def test_fit_searches_sequence_parallelism_and_the_tiled_loss(tmp_path):
    """``plan.py fit --search layout,loss_chunk``: the sp layouts (priced with their all-to-alls, their
    activations 1 / sp of the whole sequences') and the tiled loss (its chunk's logits instead of the
    micro-batch's) are candidates; at a vocabulary of 8,000 and 2,048 tokens a sequence, the tiled
    loss lowers the simulated peak and sp 4 lowers it again."""
    out = tmp_path / "fit.json"
    proc = run_script(
        REPO / "scripts" / "plan.py",
        "fit",
        "--world-size",
        "4",
        "--device-memory",
        "4GiB",
        "--search",
        "layout,loss_chunk",
        "--json",
        str(out),
        "model.preset=gpt_nano",
        "model.vocab_size=8000",
        "model.max_seq_len=8192",
        "data.seq_len=8192",
        "train.global_batch_size=4",
        "train.micro_batch_size=1",
        "dist.device=cuda",
    )
    assert proc.returncode == 0, proc.stderr
    found = {
        (
            _value(c, "parallel.sp_size"),
            _value(c, "parallel.tp_size"),
            _value(c, "parallel.pp_size"),
            _value(c, "train.loss_chunk"),
        ): c
        for c in json.loads(out.read_text())["candidates"]
    }
    plain, tiled, sp4 = found[(1, 1, 1, 0)], found[(1, 1, 1, 1024)], found[(4, 1, 1, 1024)]
    assert tiled["peak_bytes"] < plain["peak_bytes"] and sp4["peak_bytes"] < tiled["peak_bytes"]
    assert sp4["cost_parts"]["sp_comm_s"] > 0 and "sp_comm_s" not in tiled["cost_parts"]
    figure(
        "fit at 8,192 tokens, vocabulary 8,000, 4 ranks: simulated peak",
        f"plain {plain['peak_bytes'] / MIB:.1f} MiB, tiled loss {tiled['peak_bytes'] / MIB:.1f} MiB, "
        f"sp 4 + tiled {sp4['peak_bytes'] / MIB:.1f} MiB",
    )


def _value(candidate: dict, key: str) -> int:
    return next(int(o.split("=")[1]) for o in candidate["overrides"] if o.startswith(key + "="))
