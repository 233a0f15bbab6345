"""QLoRA (model.lora.quantize=nf4) on sharded models (docs/lora.md, "QLoRA").

The runs are declared in tests/batches/ (``qlora`` and its bf16-mixed, resumed, 4-rank and
wrong-base twins): LoRA's settings on a pretrained gpt_nano (a state dict file), every block Linear
stored in NF4. Their weights are read back gathered by FSDP2 itself (each unit unsharded, its NF4
dequantized: what the forward computes with, tests/workers/jobs.py). They are compared with the
single-process reference (tests/reference.py) started from the same dequantized weights: NF4 is
exact from there on, so 2 ranks must match 1 process within the fp32 parity tolerances. The rest
runs in process: NF4's bytes by formula against torchao's tensors, the export's merges, the refusals.

Covers: fsdp_zero/sharding/quantize.py, fsdp_zero/model/lora.py, fsdp_zero/checkpoint/weights.py
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fsdp_zero.config.loader import load_config
from fsdp_zero.config.schema import ParallelConfig
from fsdp_zero.distributed.topology import Topology
from fsdp_zero.model.construct import construct
from fsdp_zero.sharding.parallelize import model_state_formula
from fsdp_zero.sharding.quantize import nf4_bytes
from fsdp_zero.torch_private import to_nf4
from tests.batches import BASE, BLOCK_LINEARS, HAS_HF, QLORA
from tests.conftest import REPO, assert_user_error, check, figure, run_script
from tests.hf_fixtures import LLAMA_CONFIG
from tests.reference import reference_run
from tests.test_parity import LOSS_ATOL, NORM_ATOL, WEIGHT_ATOL

pytest.importorskip("torchao")  # the lowbit extra (in dev)
EXPORT = REPO / "scripts" / "export.py"
BLOCK, SCALER = 64, 16  # tests/batches' QLORA
QUANTIZED = [f"{n}.weight" for n in BLOCK_LINEARS]


def _base(root: Path, name: str = "qlora.pt") -> dict[str, torch.Tensor]:
    return torch.load(root / "bases" / name, weights_only=True)


def _trained(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name or name == "norm.weight"


def _cfg(root: Path, *more: str):  # noqa: ANN202
    return load_config(None, [a.format(root=root) for a in (*BASE, *QLORA, *more)])


def test_the_base_is_nf4_on_every_rank_quantized_whole_and_never_changes(batches):
    run, root = batches["qlora"], batches.root
    base = _base(root)
    # Every block Linear, never the embedding or the head; on every rank an NF4 shard.
    assert sorted(run["nf4"][0]) == sorted(QUANTIZED)
    per_rank = []
    for rank in run["nf4"]:
        assert {kind for kind, _, _ in rank.values()} == {"NF4Tensor"}, rank
        held, numel = sum(b for _, b, _ in rank.values()), sum(n for _, _, n in rank.values())
        # codes, scalers and factors split; each tensor's mean and table whole on every rank
        expected = sum(nf4_bytes(base[n].numel(), BLOCK, SCALER, 4, 2) for n in QUANTIZED)
        assert held == expected and numel * 2 == run["nf4_numel"], (held, expected, numel)
        per_rank.append(held / numel)
    # The gathered weight is the whole tensor's NF4, bit for bit (a per-shard quantization is not:
    # each shard's own scaler mean), and the frozen base is the same after 8 steps.
    for name in QUANTIZED:
        whole = to_nf4(base[name], BLOCK, SCALER).get_original_weight()
        assert torch.equal(run["initial"][name], whole), name
        assert torch.equal(run["final"][name], whole), name
    for name, value in base.items():
        if name not in QUANTIZED:
            assert torch.equal(run["initial"][name], value), name
    # Only the adapters (and model.lora.train's norm) train and hold AdamW states.
    assert run["optim_names"] == sorted(n for n in run["initial"] if _trained(n))
    for name in run["initial"]:
        same = torch.equal(run["initial"][name], run["final"][name])
        assert same != _trained(name), name
    # The model state by the formula, NF4's bytes included.
    nf4_rank = sum(nf4_bytes(base[n].numel(), BLOCK, SCALER, 4, 2) for n in QUANTIZED)
    formula = model_state_formula(
        Topology.of(ParallelConfig(), 2),
        run["num_params"],
        frozen=run["num_frozen"],
        quantized=(run["nf4_numel"], nf4_rank),
    )
    assert all(b == pytest.approx(formula, rel=0.01) for b in run["model_state_bytes"]), (
        run["model_state_bytes"],
        formula,
    )
    figure(
        "QLoRA NF4 base per rank at N=2 (gpt_nano, blocks 64 x 16)",
        f"{max(per_rank):.4f} B/param (formula {nf4_rank / (run['nf4_numel'] / 2):.4f}); "
        f"model state {max(run['model_state_bytes']) / formula:.4f} x the formula",
    )


def test_two_ranks_train_as_one_process_on_the_dequantized_base(batches):
    run, root = batches["qlora"], batches.root
    cfg = _cfg(root)
    ref = reference_run(cfg, initial=run["initial"])
    dl = max(abs(run["losses"][s] - ref["losses"][s]) for s in ref["losses"])
    dn = max(abs(run["grad_norms"][s] - ref["grad_norms"][s]) for s in ref["grad_norms"])
    dw = max((run["final"][k] - v).abs().max().item() for k, v in ref["final"].items())
    assert dl < LOSS_ATOL and dn < NORM_ATOL and dw < WEIGHT_ATOL, (dl, dn, dw)
    # Against LoRA on the original (unquantized) base: NF4's error, ~0.1 of a weight's std per
    # element, moves the losses by well under 1% over 8 steps.
    original = {**run["initial"], **{n: _base(root)[n] for n in QUANTIZED}}
    lora = reference_run(cfg, initial=original)
    rel = max(abs(run["losses"][s] / lora["losses"][s] - 1) for s in lora["losses"])
    assert 0 < rel < 1e-2, rel
    figure(
        "QLoRA at N=2 vs one process on the same NF4 base (loss, norm, weight); vs LoRA on the original",
        f"{dl:.1e}, {dn:.1e}, {dw:.1e}; losses within {rel:.2%}",
    )


def test_the_all_gather_moves_the_nf4_bytes(batches):
    """Counted all-gather bytes per step (every rank) equal the formula with each NF4 weight's
    codes, scalers and factors in place of its elements in the compute dtype."""
    import json

    from fsdp_zero.data.loader import BatchLayout
    from fsdp_zero.model.lora import make_trainable
    from fsdp_zero.monitor.comm import comm_formula
    from fsdp_zero.sharding.precision import resolve_precision
    from fsdp_zero.sharding.quantize import _nf4_gathered_bytes
    from fsdp_zero.sharding.wrap import build_wrap_plan

    path = batches.path("qlora")
    summary = json.loads((path / "summary.json").read_text())
    cfg = _cfg(batches.root)
    model = construct(cfg.model)
    make_trainable(model, cfg.model)
    shapes = dict(model.named_parameters())
    gathered = {n: _nf4_gathered_bytes(shapes[n].numel(), BLOCK, SCALER, 4) for n in QUANTIZED}
    args = (
        cfg,
        Topology.of(cfg.parallel, 2),
        model,
        build_wrap_plan(model, cfg.parallel.wrap, 2),
        BatchLayout.of(cfg.train, 2).grad_accum_steps,
        resolve_precision(cfg.precision),
    )
    nf4, plain = comm_formula(*args, gathered).all_gather, comm_formula(*args).all_gather
    assert summary["comm_formula_bytes"]["all_gather"] == pytest.approx(nf4, rel=1e-9)
    for rank in summary["ranks"]:
        assert rank["comm_bytes"]["all_gather"] == pytest.approx(nf4, rel=0.01)
    assert nf4 < 0.31 * plain, (nf4, plain)  # (0.30: the embeddings and norms gather in fp32)
    figure("QLoRA all-gather bytes / LoRA's (fp32, gpt_nano at N=2)", f"{nf4 / plain:.4f}")


def test_bf16_mixed_gathers_and_computes_the_nf4_base_in_bf16(batches):
    run, fp32 = batches["qlora-bf16"], batches["qlora"]
    assert sorted(run["nf4"][0]) == sorted(QUANTIZED)
    # bf16 compute: its losses within bf16's rounding of the fp32 run's (2 steps)
    rel = max(abs(run["losses"][s] / fp32["losses"][s] - 1) for s in run["losses"])
    assert rel < 5e-3, rel
    assert run["reduce_dtypes"] == ["torch.float32"]


def test_resume_rebuilds_the_base_and_continues_exactly(batches):
    straight, resumed = batches["qlora"], batches["qlora-resumed"]
    assert sorted(resumed["losses"]) == [5, 6, 7, 8]
    for step, loss in resumed["losses"].items():
        assert loss == straight["losses"][step], step
    for name, value in straight["final"].items():
        assert torch.equal(resumed["final"][name], value), name
    # The checkpoint holds no NF4 weight: the base is rebuilt from its file and its digest checked.
    from fsdp_zero.checkpoint.weights import _saved_weights

    ckpt = batches.path("qlora") / "checkpoints" / "step-0000004"
    saved, _ = _saved_weights(ckpt)
    assert not set(QUANTIZED) & set(saved) and "layers.0.attention.wq.lora_A.weight" in saved
    error = batches["qlora-other-base"]["error"]  # None: the resume went through
    assert error and "is not the one its adapters were trained on" in error, error
    assert "qlora-nudged.pt" in error


def test_a_checkpoint_continues_at_four_ranks(batches):
    straight, moved = batches["qlora"], batches["qlora-n4"]
    assert sorted(moved["nf4"][0]) == sorted(QUANTIZED) and len(moved["nf4"]) == 4
    dl = max(abs(moved["losses"][s] - straight["losses"][s]) for s in moved["losses"])
    dw = max((moved["final"][k] - v).abs().max().item() for k, v in straight["final"].items())
    assert dl < LOSS_ATOL and dw < WEIGHT_ATOL, (dl, dw)


def test_export_merges_into_the_trained_base_or_the_original(batches, tmp_path: Path):
    run, root = batches["qlora"], batches.root
    from safetensors.torch import load_file

    ckpt = batches.path("qlora") / "checkpoints" / "step-0000008"
    trained, original = tmp_path / "trained", tmp_path / "original"
    check(run_script(EXPORT, str(ckpt), "--out", str(trained)))
    check(run_script(EXPORT, str(ckpt), "--out", str(original), "--merge-into", "original"))
    a, b = load_file(trained / "model.safetensors"), load_file(original / "model.safetensors")
    base, final = _base(root), run["final"]
    assert sorted(a) == sorted(b) == sorted(base)
    for name in QUANTIZED:
        module = name.removesuffix(".weight")
        delta = 0
        if f"{module}.lora_A.weight" in final:
            delta = 4 * final[f"{module}.lora_B.weight"] @ final[f"{module}.lora_A.weight"]
        torch.testing.assert_close(a[name], final[name] + delta, rtol=0, atol=1e-6)
        torch.testing.assert_close(b[name], base[name] + delta, rtol=0, atol=1e-6)
    # The trained export computes what the QLoRA model computed.
    model = construct(_cfg(root).model).to_empty(device="cpu")
    model.load_state_dict(a, strict=False)
    from fsdp_zero.model.construct import real_buffers

    for name, value in real_buffers(construct(_cfg(root).model)).items():
        model.get_buffer(name).copy_(value)
    from fsdp_zero.data.batches import build_source

    cfg = _cfg(root)
    inputs = build_source(cfg.data, cfg.train.seed, 256).batch(range(2))[0]
    with torch.no_grad():
        diff = (model(inputs) - run["logits"]).abs().max().item()
    assert diff < 1e-4, diff
    # A base file that changed since: refused, nothing written.
    moved = tmp_path / "moved-ckpt"
    import shutil

    shutil.copytree(ckpt, moved)
    state = (moved / "train_state.json").read_text()
    other = str(root / "bases" / "qlora-nudged.pt")
    (moved / "train_state.json").write_text(state.replace(str(root / "bases" / "qlora.pt"), other))
    proc = run_script(EXPORT, str(moved), "--out", str(tmp_path / "bad"))
    assert proc.returncode == 2 and "no longer holds the base" in proc.stderr, proc.stderr
    assert not (tmp_path / "bad").exists() and not any(tmp_path.glob(".bad*"))


@pytest.mark.skipif(not HAS_HF, reason="needs the hf extra (transformers, peft)")
def test_the_shipped_config_fine_tunes_a_llama_and_exports_a_from_pretrained_folder(
    batches, tmp_path: Path
):
    """configs/qlora.yaml on a Hugging Face Llama: every projection in NF4 (the tied embedding and
    head not), and the merged export, loaded by from_pretrained, computes what the trained model did."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run, root = batches["qlora-llama"], batches.root
    projections = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    assert sorted(run["nf4"][0]) == sorted(
        f"model.layers.{i}.{kind}.{p}.weight"
        for i in range(2)
        for kind, ps in (("self_attn", projections[:4]), ("mlp", projections[4:]))
        for p in ps
    )
    ckpt = batches.path("qlora-llama") / "checkpoints" / "step-0000004"
    merged, adapters = tmp_path / "merged", tmp_path / "adapters"
    check(run_script(EXPORT, str(ckpt), "--out", str(merged)))
    check(run_script(EXPORT, str(ckpt), "--out", str(adapters), "--adapters-only"))
    cfg = load_config(batches.path("qlora-llama") / "config.yaml")  # (the run's seed resolved)
    from fsdp_zero.data.batches import build_source

    inputs = build_source(cfg.data, cfg.train.seed, LLAMA_CONFIG["vocab_size"]).batch(range(2))[0]
    with torch.no_grad():
        logits = AutoModelForCausalLM.from_pretrained(merged).eval()(inputs).logits
        # (the run computed in bf16: its logits within bf16's rounding of the fp32 export's)
        diff = (logits - run["logits"]).abs().max().item() / run["logits"].abs().max().item()
        assert diff < 2e-2, diff
        # PEFT loads the adapters onto the original base (not NF4's): close to the merged model
        peft = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(root / "tiny-llama"), adapters
        ).eval()
        gap = (peft(inputs).logits - logits).abs().max().item() / logits.abs().max().item()
    assert gap < 0.1, gap
    figure(
        "configs/qlora.yaml on a tiny Llama: merged export vs the run; PEFT on the original base vs merged (max rel)",
        f"{diff:.1e}; {gap:.1e}",
    )


def test_nf4_bytes_per_parameter_at_the_default_blocks():
    """0.516 B per parameter: torchao's tensors against `nf4_bytes`, whole and in two shards."""
    from fsdp_zero.monitor.memory import _storage_bytes

    w = torch.randn(512, 256)
    nf4 = to_nf4(w, 64, 256)
    assert _storage_bytes([nf4], set()) == nf4_bytes(w.numel())
    assert nf4_bytes(4096 * 4096) / (4096 * 4096) == pytest.approx(0.5159, abs=1e-4)
    # the 70B planner line's per-parameter cost
    assert nf4_bytes(8192 * 28672, shards=2) / (8192 * 28672 / 2) < 0.52


def _quantized(path: Path, seed: int, *more: str):  # noqa: ANN202
    """A seeded random gpt_nano base saved at ``path``, and the meta-device LoRA model of QLORA + ``more``
    started from it, quantized for 2 ranks in this process (the quantizer run on the root unit: every
    weight); returns the base, the model and its `NF4Base`."""
    from fsdp_zero.model.lora import make_trainable
    from fsdp_zero.sharding.quantize import plan_nf4

    gen = torch.Generator().manual_seed(seed)
    shapes = construct(load_config(None, list(BASE)).model).state_dict()
    base = {n: torch.randn(t.shape, generator=gen) for n, t in shapes.items()}
    torch.save(base, path)
    cfg = _cfg(path.parent, *more, f"model.init_from={path}")
    model = construct(cfg.model)
    make_trainable(model, cfg.model)
    nf4 = plan_nf4(cfg.model, cfg.parallel.wrap, model, 2)
    nf4.quantizer(model)("", model)
    return base, model, nf4


def test_the_nf4_block_size_reaches_the_quantizer(tmp_path: Path):
    """model.lora.nf4_block_size=32 (not the default 64): every quantized weight is torchao's NF4 at
    blocks of 32 x 16, bit for bit the base's, at the bytes `nf4_bytes` counts for them; the export
    rebuilds the same base from the record (its digest verified)."""
    from fsdp_zero.monitor.memory import _storage_bytes
    from fsdp_zero.sharding.quantize import RebuiltBase

    base, model, nf4 = _quantized(tmp_path / "base.pt", 0, "model.lora.nf4_block_size=32")
    assert sorted(nf4.names) == sorted(QUANTIZED) and (nf4.block, nf4.scaler_block) == (32, SCALER)
    for name in QUANTIZED:
        w = model.get_parameter(name)
        assert type(w).__name__ == "NF4Tensor" and not w.requires_grad, name
        assert (w.block_size, w.scaler_block_size) == (32, SCALER), name
        whole = to_nf4(base[name], 32, SCALER).get_original_weight()
        assert torch.equal(w.get_original_weight(), whole), name
        assert _storage_bytes([w], set()) == nf4_bytes(w.numel(), 32, SCALER), name
    rebuilt = RebuiltBase(nf4.record(), original=False)
    for name in QUANTIZED:
        rebuilt.read(name)
    rebuilt.verify()  # raises where the record's blocks rebuild another base ("no longer holds the base")


def test_a_resume_checks_the_rebuilt_bases_digest_not_its_path(tmp_path: Path):
    """A base file changed in place (the same path, other weights) rebuilds to another NF4 digest: the
    resume is refused, naming both digests; the same weights at another path are taken (and recorded)."""
    from fsdp_zero.checkpoint.dcp import TrainState
    from fsdp_zero.checkpoint.weights import check_rebuilt_base

    ckpt, path = tmp_path / "checkpoints" / "step-0000004", tmp_path / "base.pt"
    _, _, trained = _quantized(path, 0)
    state = TrainState(step=4, nf4_base=trained.record())
    _, _, changed = _quantized(path, 1)  # the file rewritten with other weights
    assert changed.source == trained.source and changed.digest != trained.digest
    with pytest.raises(ValueError) as refused:
        check_rebuilt_base(changed, state, ckpt)
    message = str(refused.value)
    assert f"(digest {changed.digest}) is not the one its adapters were trained on" in message
    assert f"(digest {trained.digest}, from" in message and state.nf4_base == trained.record()
    _, _, moved = _quantized(tmp_path / "moved.pt", 0)
    assert moved.source != trained.source and moved.digest == trained.digest
    check_rebuilt_base(moved, state, ckpt)
    assert state.nf4_base == moved.record()


def test_the_plan_counts_nf4_at_its_bytes_for_a_70b_model_on_two_ranks():
    """plan.py formulas --params 70e9 --world-size 2 --frozen --nf4: the formulas' QLoRA (Llama-2-70B's split:
    68.5e9 Linear weights in NF4, 1.3e9 other frozen, 0.2e9 adapters), and a QLoRA config's counts."""
    from fsdp_zero.tools.formulas import Trained, strategy_states

    p, f, q, n = 70e9, 69.8e9, 68.5e9, 2
    rows = {
        (s.strategy.value, s.mode): s
        for s in strategy_states(int(p), n, int(0.86e9), 0, trained=Trained(int(f), int(q)))
    }
    nf4 = nf4_bytes(int(q), shards=n)
    assert nf4 / (q / n) == pytest.approx(0.5159, abs=1e-4)
    # bf16-mixed: 4 B of each other frozen weight, 16 of each trained one, all / N
    at_rest = rows[("full_shard", "bf16-mixed")].at_rest
    assert at_rest == pytest.approx((4 * (f - q) + 16 * (p - f)) / n + nf4, rel=1e-12)
    assert 20 * 2**30 < at_rest < 21 * 2**30
    assert rows[("ddp", "fp32")].refused and "FSDP strategy" in rows[("ddp", "fp32")].refused
    assert "valid choices: fp32, bf16-mixed" in rows[("full_shard", "bf16-true")].refused
    out = run_script(
        REPO / "scripts" / "plan.py",
        "formulas",
        *("--params", "70e9", "--world-size", "2", "--frozen", "69.8e9", "--nf4", "68.5e9"),
    )
    assert out.returncode == 0 and "of those in NF4 (QLoRA): 0.5159 B each" in out.stdout, out
    assert "| full_shard | 20.37 GiB |" in out.stdout, out.stdout
    bad = run_script(
        REPO / "scripts" / "plan.py",
        "formulas",
        "--params",
        "1e9",
        "--world-size",
        "2",
        "--nf4",
        "2e9",
    )
    assert bad.returncode == 2 and "--nf4 <= --frozen" in bad.stderr


def test_the_planner_predicts_the_runs_model_state_without_reading_the_base(batches):
    """plan.py's simulation of a QLoRA config: the LoRA model simulated, the NF4 saving taken by
    formula: the model state it predicts is what the qlora run measured."""
    from fsdp_zero.config.strategies import Strategy
    from fsdp_zero.tools.planner import simulate

    run = batches["qlora"]
    (pred,) = simulate(_cfg(batches.root), 2, [Strategy.full_shard])
    assert pred.model_state == pytest.approx(run["model_state_bytes"][0], rel=0.01), (
        pred.model_state,
        run["model_state_bytes"],
    )
    assert any("QLoRA" in note for note in pred.notes)


@pytest.mark.parametrize(
    "args,message",
    [
        (("model.lora.quantize=nf4",), "model.lora.rank=0 (LoRA off)"),
        (
            ("model.lora.rank=4", "model.lora.targets=[wq]", "model.lora.quantize=nf4"),
            "quantizes a pretrained base, and none is given",
        ),
        (
            (*QLORA, "parallel.strategy=ddp"),
            "model.lora.quantize=nf4 with parallel.strategy=ddp is not supported: it needs an FSDP",
        ),
        ((*QLORA, "precision=bf16-true"), "not supported"),
        ((*QLORA, "precision=fp16-mixed"), "valid choices: fp32, bf16-mixed"),
        ((*QLORA, "model.lora.quantize=int4"), "valid choices: none, nf4"),
        # one rank: FSDP2 cannot gather an NF4 weight it does not split
        ((*QLORA,), "at a shard degree of 1"),
        (
            (*QLORA, r"model.lora.quantize_targets=[layers\.0\.attention\.wq\.lora_A]"),
            "layers.0.attention.wq.lora_A.weight trains",
        ),
        ((*QLORA, "model.lora.quantize_targets=[nothing]"), "matches no nn.Linear"),
    ],
)
def test_qlora_refusals_exit_2_in_one_line(tmp_path: Path, qlora_base: Path, args, message):
    args = tuple(a.replace("{root}", str(qlora_base)) for a in args)
    assert_user_error(tmp_path, message, *BASE, *args)


@pytest.fixture(scope="module")
def qlora_base(tmp_path_factory) -> Path:  # noqa: ANN001
    from tests.batches import _qlora_bases

    root = tmp_path_factory.mktemp("qlora-base")
    _qlora_bases(root)
    return root


def test_whole_blocks_per_shard_are_checked_before_anything_is_read():
    from fsdp_zero.sharding.quantize import check_nf4

    check_nf4({"w": torch.Size([64, 64])}, 4, 64, 16)
    with pytest.raises(ValueError, match=r"w \(64, 64\) does not split into 2 shards"):
        check_nf4({"w": torch.Size([64, 64])}, 2, 64, 256)
    with pytest.raises(ValueError, match=r"dim 0 divisible by 3"):
        check_nf4({"w": torch.Size([64, 96])}, 3, 64, 16)
