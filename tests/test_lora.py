"""Frozen parameters (model.freeze) and LoRA (model.lora) on sharded models (docs/lora.md).

The runs are declared in tests/batches/ (``freeze``, ``lora`` and its 1-, 4-rank and resumed
twins): the parity suite's base, 8 AdamW steps with clipping on every step. Each is compared with
the single-process reference (tests/reference.py), which freezes the same parameters and builds and
initialises its adapters by hand, so a wrong LoRA forward, scaling or adapter init fails the parity.
The rest runs in process without training: LoRALinear's sum, dropout and init against values computed
by hand, the full-match rule of model.freeze and model.lora.train, and export.py's --adapters-only refusals.

Covers: fsdp_zero/model/lora.py, fsdp_zero/config/lora.py, fsdp_zero/checkpoint/export.py
"""

from __future__ import annotations

import importlib.util
import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fsdp_zero.config.loader import load_config, to_yaml
from fsdp_zero.config.schema import ParallelConfig
from fsdp_zero.data.batches import build_source
from fsdp_zero.distributed.topology import Topology
from fsdp_zero.model import init as init_lib
from fsdp_zero.model.construct import construct
from fsdp_zero.model.lora import LoRALinear, init_adapters, make_trainable
from fsdp_zero.sharding.parallelize import model_state_formula
from tests.batches import BASE, BY_NAME, FREEZE, HAS_HF, LORA
from tests.conftest import TRAIN, assert_user_error, check, figure, run_script
from tests.hf_fixtures import LLAMA_CONFIG
from tests.reference import reference_run
from tests.test_parity import LOSS_ATOL, NORM_ATOL, WEIGHT_ATOL

FROZEN = ("tok_embeddings.weight", r"layers\.0\.attention\..*")


def _is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def _lora_trained(name: str) -> bool:
    return _is_adapter(name) or name == "norm.weight"


def _check_frozen_and_trained(run: dict, trained) -> None:  # noqa: ANN001
    """Every frozen tensor bit-identical to its start, every trained one changed; AdamW states for
    the trained ones only."""
    names = sorted(run["initial"])
    assert run["optim_names"] == sorted(n for n in names if trained(n))
    for name in names:
        same = torch.equal(run["initial"][name], run["final"][name])
        assert same != trained(name), (name, "changed" if not same else "unchanged")


def _check_model_state(run: dict, world_size: int) -> float:
    """Every rank's model state within 2% of the formula with the run's frozen count; returns the ratio."""
    formula = model_state_formula(
        Topology.of(ParallelConfig(), world_size), run["num_params"], frozen=run["num_frozen"]
    )
    ratios = [b / formula for b in run["model_state_bytes"]]
    assert all(abs(r - 1) < 0.02 for r in ratios), ratios
    return max(ratios, key=lambda r: abs(r - 1))


def _check_against(run: dict, ref: dict) -> tuple[float, float, float]:
    """Losses, norms and final weights within the parity suite's fp32 tolerances; returns the largest differences."""
    dl = max(abs(run["losses"][s] - ref["losses"][s]) for s in ref["losses"])
    dn = max(abs(run["grad_norms"][s] - ref["grad_norms"][s]) for s in ref["grad_norms"])
    dw = max((run["final"][k] - v).abs().max().item() for k, v in ref["final"].items())
    assert sorted(run["losses"]) == sorted(ref["losses"])
    assert dl < LOSS_ATOL and dn < NORM_ATOL and dw < WEIGHT_ATOL, (dl, dn, dw)
    return dl, dn, dw


def test_freeze_trains_only_the_rest_and_matches_the_reference(batches):
    run = batches["freeze"]
    frozen = lambda n: any(re.fullmatch(p, n) for p in FROZEN)  # noqa: E731
    assert any(frozen(n) for n in run["initial"])
    _check_frozen_and_trained(run, lambda n: not frozen(n))
    assert run["num_frozen"] == sum(v.numel() for n, v in run["initial"].items() if frozen(n))
    ratio = _check_model_state(run, 2)
    ref = reference_run(load_config(None, [*BASE, *FREEZE]))
    dl, dn, dw = _check_against(run, ref)
    figure(
        "model.freeze at N=2 vs reference (loss, norm, weight)",
        f"{dl:.1e}, {dn:.1e}, {dw:.1e}; model state {ratio:.4f} x the formula",
    )


@pytest.fixture(scope="module")
def lora_reference() -> dict:
    return reference_run(load_config(None, [*BASE, *LORA]))


@pytest.mark.parametrize("name,n", [("lora-n1", 1), ("lora", 2), ("lora-n4", 4)])
def test_lora_trains_adapters_only_at_any_world_size(batches, lora_reference, name, n):
    run = batches[name]
    _check_frozen_and_trained(run, _lora_trained)
    adapted = {k.rpartition(".lora_B.")[0] for k in run["final"] if ".lora_B." in k}
    layers = {int(m.group(1)) for k in adapted if (m := re.match(r"layers\.(\d+)\.", k))}
    assert layers == set(range(2)) and len(adapted) == 6, adapted  # wq, wv, w2 in both layers
    assert all(not run["final"][f"{k}.lora_B.weight"].eq(0).all() for k in adapted)
    # inside their block units
    assert not any("lora" in unit for unit in run["unit_params"]), run["unit_params"]
    assert sum(run["unit_params"].values()) == run["num_params"]
    # The initial adapters do not depend on the world size; B starts at zero.
    assert all(run["initial"][f"{k}.lora_B.weight"].eq(0).all() for k in adapted)
    for k, v in lora_reference["initial"].items():
        assert torch.equal(run["initial"][k], v), k
    ratio = _check_model_state(run, n)
    dl, dn, dw = _check_against(run, lora_reference)
    figure(
        f"LoRA at N={n} vs reference (loss, norm, weight)",
        f"{dl:.1e}, {dn:.1e}, {dw:.1e}; model state {ratio:.4f} x the formula",
    )


def test_lora_resume_is_exact(batches):
    straight, resumed = batches["lora"], batches["lora-resumed"]
    assert sorted(resumed["losses"]) == [5, 6, 7, 8]
    for step, loss in resumed["losses"].items():
        assert loss == straight["losses"][step], step
    for name, value in straight["final"].items():
        assert torch.equal(resumed["final"][name], value), name


def test_lora_checkpoint_continues_at_another_world_size(batches):
    # saved at 2 ranks after step 4, continued at 4
    straight, resharded = batches["lora"], batches["lora-reshard4"]
    assert sorted(resharded["losses"]) == [5, 6, 7, 8]
    for step, loss in resharded["losses"].items():
        assert abs(loss - straight["losses"][step]) < LOSS_ATOL, step
    for name, value in straight["final"].items():
        assert (resharded["final"][name] - value).abs().max() < WEIGHT_ATOL, name
    assert resharded["optim_names"] == straight["optim_names"]


NANO = [
    "model.preset=gpt_nano",
    "data.seq_len=32",
    "train.global_batch_size=8",
    "train.micro_batch_size=2",
    "train.steps=1",
]


@pytest.mark.parametrize(
    "args,message",
    [
        (
            ["model.lora.rank=4", "model.lora.targets=[q_proj]"],
            "model.lora.targets: 'q_proj' matches no nn.Linear (by last name component or full name); the model's "
            "Linear "
            "modules: layers.0.attention.wq",
        ),
        (
            ["model.lora.targets=[wq]"],
            "model.lora.targets=['wq'] is set but model.lora.rank=0 (LoRA off)",
        ),
        (
            ["model.freeze=[tok_emb.weight]"],
            "model.freeze: 'tok_emb.weight' matches no parameter (full match); the model's parameters: "
            "tok_embeddings.weight",
        ),
        # A prefix of every layer-1 name (and, as a prefix, of nothing else on 2 layers) is no full match of any.
        (
            [r"model.freeze=[layers\.1]"],
            r"model.freeze: 'layers\\.1' matches no parameter (full match)",
        ),
        (
            ["model.lora.rank=4", "model.lora.targets=[wq]", "precision=bf16-true"],
            "with precision.mode=bf16-true is not supported",
        ),
    ],
)
def test_bad_freeze_and_lora_settings_exit_2_with_one_line(tmp_path: Path, args, message):
    assert_user_error(tmp_path, message, *NANO, *args)


def test_the_start_up_lines_say_what_trains(tmp_path: Path):
    proc = check(
        run_script(
            TRAIN, *NANO, *LORA, "checkpoint.enabled=false", f"run.root={tmp_path}", "run.name=ok"
        )
    )
    assert re.search(
        r"trained: LoRA rank 4, alpha 16 on 6 Linear modules \(layers\.0\.attention\.wq, .*\); "
        r"[\d,]+ trainable parameters, [\d,]+ frozen",
        proc.stderr,
    ), proc.stderr
    assert re.search(
        r"model state 16 B x [\d,]+ params / 1 \(not sharded\), [\d,]+ of them frozen \(weights only, "
        r"4 B\) = ",
        proc.stderr,
    ), proc.stderr


def test_formula_without_frozen_parameters_is_unchanged():
    for strategy in ("full_shard", "zero1", "ddp", "hybrid_shard"):
        topology = Topology.of(ParallelConfig(strategy=strategy), 4)
        assert model_state_formula(topology, 1001) == model_state_formula(topology, 1001, frozen=0)
    # fp32 full_shard: 4 B per frozen parameter, 16 per trainable, over N.
    assert (
        model_state_formula(Topology.of(ParallelConfig(), 4), 1000, frozen=600)
        == (4 * 600 + 16 * 400) / 4
    )
    # zero1: weights and gradients whole, AdamW states split; frozen ones hold only their weights.
    assert (
        model_state_formula(Topology.of(ParallelConfig(strategy="zero1"), 4), 1000, frozen=600)
        == 4 * 1000 + 4 * 400 + 8 * 400 / 4
    )


EXPORT = TRAIN.parent / "export.py"


@pytest.mark.skipif(
    not HAS_HF or importlib.util.find_spec("peft") is None,
    reason="needs the hf extra (transformers, peft)",
)
def test_lora_on_a_pretrained_llama_exports_merged_and_for_peft(batches, tmp_path: Path):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    run, root = batches["pretrained-lora"], batches.root
    base = load_file(root / "tiny-llama" / "model.safetensors")
    # the base weights loaded; the adapters initialised, not loaded
    for name, value in base.items():
        assert torch.equal(run["initial"][name], value), name
    adapted = sorted({k.rpartition(".lora_A.")[0] for k in run["final"] if ".lora_A." in k})
    assert len(adapted) == 4 and all(k.endswith(("q_proj", "v_proj")) for k in adapted), adapted
    ckpt = batches.path("pretrained-lora") / "checkpoints" / "step-0000004"

    # Merged (the default): only the adapted weights differ from the base, each by alpha/rank x B A.
    merged = tmp_path / "merged"
    check(run_script(EXPORT, str(ckpt), "--out", str(merged)))
    weights = load_file(merged / "model.safetensors")
    assert not any(".lora_" in k for k in weights)
    final = run["final"]
    for name, value in base.items():
        module = name.removesuffix(".weight")
        if module in adapted:
            delta = (16 / 4) * final[f"{module}.lora_B.weight"] @ final[f"{module}.lora_A.weight"]
            assert delta.abs().max() > 0, name
            torch.testing.assert_close(weights[name], base[name] + delta, rtol=0, atol=1e-6)
        else:
            assert torch.equal(weights[name], value), name
    cfg = load_config(None, [a.format(root=root) for a in BY_NAME["pretrained-lora"].args])
    inputs = build_source(cfg.data, cfg.train.seed, LLAMA_CONFIG["vocab_size"]).batch(range(2))[0]
    with torch.no_grad():
        merged_logits = AutoModelForCausalLM.from_pretrained(merged).eval()(inputs).logits
    diff = (merged_logits - run["logits"]).abs().max().item()
    assert diff <= 1e-5, diff

    # Adapters only: PEFT loads them onto the base and gives the merged model's outputs.
    adapters = tmp_path / "adapters"
    check(run_script(EXPORT, str(ckpt), "--out", str(adapters), "--adapters-only"))
    assert sorted(p.name for p in adapters.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    peft = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(root / "tiny-llama"), adapters
    ).eval()
    with torch.no_grad():
        peft_diff = (peft(inputs).logits - merged_logits).abs().max().item()
    figure(
        "LoRA export: from_pretrained(merged) vs the trained model; PEFT vs merged (logits, max abs diff)",
        f"{diff:.1e}; {peft_diff:.1e}",
    )
    assert peft_diff <= 1e-5, peft_diff
    # The planner's formulas take the same count.
    from fsdp_zero.tools.formulas import Trained, strategy_states

    rows = {
        (s.strategy.value, s.mode): s.at_rest
        for s in strategy_states(1000, 4, modes=("fp32",), trained=Trained(frozen=600))
    }
    assert (
        rows[("full_shard", "fp32")] == (4 * 600 + 16 * 400) / 4
        and rows[("ddp", "fp32")] == 4 * 1000 + 12 * 400
    )


# ---------------------------------------------------------------------------------
# In process, no training: LoRALinear against values computed by hand, the full-match rule, export refusals


def _lora_7_to_5(dropout: float = 0.0) -> LoRALinear:
    """A seeded ``LoRALinear(nn.Linear(7, 5), rank=2, alpha=6)`` in float64 (scaling alpha/rank = 3) with
    non-zero A and B, so that the adapter term is as large as the base term and every factor shows."""
    # the seed stays with this layer: later tests see the RNG as it was
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        m = LoRALinear(nn.Linear(7, 5, dtype=torch.float64), rank=2, alpha=6, dropout=dropout)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        m.lora_A.weight.copy_(torch.randn(2, 7, generator=g, dtype=torch.float64))
        m.lora_B.weight.copy_(torch.randn(5, 2, generator=g, dtype=torch.float64))
    return m


def _inputs() -> torch.Tensor:
    # (batch, seq, in)
    return torch.randn(3, 4, 7, generator=torch.Generator().manual_seed(2), dtype=torch.float64)


def test_lora_linear_adds_alpha_over_rank_times_b_a_x_by_hand():
    """Guards LoRALinear's forward, ``W x + b + (alpha / rank) * B(A(x))``, and its scaling alpha/rank
    (3 here): a scaling of alpha (6), a missing bias or the adapter on the wrong side fails it. The
    parity tests see the same through the reference; this one needs no training and no extra package."""
    m, x = _lora_7_to_5(), _inputs()
    W, b, A, B = m.weight, m.bias, m.lora_A.weight, m.lora_B.weight
    base = x @ W.T + b
    expected = base + 3 * (x @ A.T) @ B.T
    assert (expected - base).abs().max() > 1, "the adapter term must be large next to the tolerance"
    with torch.no_grad():
        torch.testing.assert_close(m(x), expected, rtol=0, atol=1e-12)


def test_init_adapters_draws_a_within_one_over_sqrt_in_and_zeroes_b():
    """Guards the adapters' initial values (PEFT's default): A ~ U(-1/sqrt(in), 1/sqrt(in)), drawn by
    `fsdp_zero.model.init.uniform_` from the seed and A's name (what makes them world-size invariant), and
    B = 0 so training starts from the base model; the base weights untouched.

    With in = 7 and out = 5, a bound of 1/sqrt(out) is the larger one: it puts some of A's 14 values
    above 1/sqrt(7) (and changes every value of the exact draw); a bound too small leaves them all
    below 0.8/sqrt(7)."""
    # A's name is then "proj.lora_A.weight", as in a model
    parent = nn.ModuleDict({"proj": _lora_7_to_5()})
    m = parent["proj"]
    base = m.weight.detach().clone(), m.bias.detach().clone()
    init_adapters(parent, seed=3)
    A, B = m.lora_A.weight, m.lora_B.weight
    assert A.abs().max() <= 1 / math.sqrt(7), A
    assert A.abs().max() > 0.8 / math.sqrt(7), A
    assert torch.equal(B, torch.zeros(5, 2, dtype=B.dtype))
    drawn = torch.empty(2, 7, dtype=A.dtype)
    init_lib.uniform_(drawn, bound=1 / math.sqrt(7), seed=3, name="proj.lora_A.weight")
    assert torch.equal(A, drawn)
    assert torch.equal(m.weight, base[0]) and torch.equal(m.bias, base[1])


def test_lora_dropout_masks_only_the_adapter_input_and_only_in_training():
    """Guards ``model.lora.dropout`` ("B(A(dropout(x)))"): in train() mode each forward drops a fresh
    mask of x's elements, scaled by 1/(1-p), before A only (the base term sees all of x), so two seeds
    give two outputs; in eval() there is no dropout and the output is the same for any seed."""
    m, x = _lora_7_to_5(dropout=0.5), _inputs()
    W, b, A, B = m.weight, m.bias, m.lora_A.weight, m.lora_B.weight
    m.train()
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(1)
        out1 = m(x)
        # the same mask again, as dropout draws it: each kept element is 1 / (1 - p) = 2
        torch.manual_seed(1)
        mask = F.dropout(torch.ones_like(x), 0.5, training=True)
        torch.manual_seed(2)
        out2 = m(x)
    assert set(mask.unique().tolist()) == {0.0, 2.0}
    assert (out1 - out2).abs().max() > 0.1, "two seeds, two masks: the outputs must differ"
    torch.testing.assert_close(out1, x @ W.T + b + 3 * ((mask * x) @ A.T) @ B.T, rtol=0, atol=1e-12)
    m.eval()
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(1)
        eval1 = m(x)
        torch.manual_seed(2)
        eval2 = m(x)
    assert torch.equal(eval1, eval2)
    torch.testing.assert_close(eval1, x @ W.T + b + 3 * (x @ A.T) @ B.T, rtol=0, atol=1e-12)


def _frozen(*overrides: str) -> set[str]:
    """The parameters `make_trainable` freezes on a 12-layer gpt_nano built on the meta device (no memory)."""
    cfg = load_config(None, ["model.preset=gpt_nano", "model.n_layers=12", *overrides])
    model = construct(cfg.model)
    make_trainable(model, cfg.model)
    return {n for n, p in model.named_parameters() if not p.requires_grad}


def test_freeze_and_train_patterns_match_whole_names_on_twelve_layers():
    """Guards "full matches on the parameter names" (docs/lora.md) for ``model.freeze`` and
    ``model.lora.train``: on 12 layers "layers.1" is a prefix of layers.10 and layers.11 as well, so a
    prefix match (re.match) or a search would freeze, or refuse, more than the pattern says."""
    layer1 = {
        f"layers.1.{m}.weight"
        for m in (
            "attention_norm",
            "ffn_norm",
            *(f"attention.w{x}" for x in "qkvo"),
            *(f"feed_forward.w{i}" for i in (1, 2, 3)),
        )
    }
    assert _frozen(r"model.freeze=[layers\.1\..*]") == layer1
    # A regex, not a glob: "layers\.1.*" does reach layers 10 and 11 (9 parameters each).
    assert {n.split(".")[1] for n in _frozen(r"model.freeze=[layers\.1.*]")} == {"1", "10", "11"}
    with pytest.raises(
        ValueError, match=r"model.freeze: 'layers\\\\.1' matches no parameter \(full match\)"
    ):
        _frozen(r"model.freeze=[layers\.1]")
    # With LoRA every base parameter is frozen except those model.lora.train matches in full.
    lora = ("model.lora.rank=2", "model.lora.targets=[wq]")
    frozen = _frozen(*lora, r"model.lora.train=[layers\.1\..*]")
    assert not frozen & layer1 and {n for n in frozen if n.startswith("layers.1")} >= {
        "layers.10.ffn_norm.weight",
        "layers.11.ffn_norm.weight",
    }
    assert not any(".lora_" in n for n in frozen)
    with pytest.raises(
        ValueError, match=r"model.lora.train: 'norm' matches no parameter \(full match\)"
    ):
        _frozen(*lora, "model.lora.train=[norm]")  # a prefix of norm.weight only


LORA_ONLY = ("model.lora.rank=4", "model.lora.targets=[wq]")  # adapters and nothing else trained


@pytest.mark.parametrize(
    "overrides,args,out,message",
    [
        (
            (),
            ("--adapters-only",),
            "adapters",
            "--adapters-only: checkpoint {ckpt!r} has no LoRA adapters (its config.yaml has no model.lora.rank); "
            "export it "
            "without --adapters-only",
        ),
        (
            LORA,
            ("--adapters-only",),
            "adapters",
            "--adapters-only: the run also trained model.lora.train=['norm.weight'], which an adapter file does not "
            "hold; "
            "export without --adapters-only (merged) to keep them",
        ),
        (
            LORA_ONLY,
            ("--adapters-only", "--max-shard-size", "1MB"),
            "adapters",
            "--adapters-only writes one folder of two files: give --out a folder, no --max-shard-size",
        ),
        (
            LORA_ONLY,
            ("--adapters-only",),
            "adapters.safetensors",
            "--adapters-only writes one folder of two files: give --out a folder, no --max-shard-size",
        ),
    ],
    ids=["no-lora", "lora-train", "max-shard-size", "safetensors-out"],
)
def test_adapters_only_refusals_exit_2_in_one_line_and_write_nothing(
    tmp_path: Path, overrides, args, out, message
):
    """Guards scripts/export.py's ``--adapters-only`` refusals: a run without LoRA; a run that also
    trained ``model.lora.train`` (an adapter file would silently lose those weights); a size limit or a
    single ``.safetensors`` file (the output is PEFT's folder of two files). Each is one line and exit
    2, decided from config.yaml before any tensor is read (the checkpoint here holds nothing else), and
    nothing is written."""
    ckpt = tmp_path / "step-0000004"
    ckpt.mkdir()
    (ckpt / "config.yaml").write_text(to_yaml(load_config(None, [*NANO, *overrides])))
    proc = run_script(EXPORT, str(ckpt), "--out", str(tmp_path / out), *args)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [f"error: {message.format(ckpt=str(ckpt))}"], proc.stderr
    assert proc.stdout == ""
    assert [p.name for p in tmp_path.iterdir()] == [ckpt.name] and [
        p.name for p in ckpt.iterdir()
    ] == ["config.yaml"]
