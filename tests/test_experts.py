"""Mixtures of experts and expert parallelism (``parallel.ep_size``) against one process.

The runs (tests/batches/runs_experts.py): the built-in moe_nano (8 experts, top 2) at ep 2 on 2
ranks, ep 2 x dp 2 and ep 4 (every block recomputed: its dispatch runs again in backward) on 4,
ep 2 under hybrid_shard (2 replicas of an ep 2 shard group), its top-1 twin whose routers start at
zero (every token to expert 0, on rank 0: the other rank's experts receive nothing), LoRA on the
attention with the experts frozen, a Hugging Face Qwen3-MoE at ep 2, and ep 2's step-4 checkpoint
continued at ep 4 and at one rank. Each trains like single-process training of the same model on
the same global batch (tests/reference.py, which writes the load-balancing loss by hand), within
the parity suite's fp32 tolerances; each rank holds its slice of the experts, sharded over the
ranks ep leaves; the dispatch's counted bytes are its routing's.

Covers: fsdp_zero/sharding/experts.py, fsdp_zero/model/transformer.py, fsdp_zero/model/tasks.py,
    fsdp_zero/model/contract.py, fsdp_zero/monitor/comm.py, fsdp_zero/distributed/topology.py,
    fsdp_zero/tools/planner.py
"""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from fsdp_zero.config.loader import load_config
from fsdp_zero.config.presets import model_args
from fsdp_zero.config.schema import ParallelConfig
from fsdp_zero.distributed.topology import Role, Topology
from fsdp_zero.model.tasks import load_balance_loss
from fsdp_zero.model.transformer import Router, Transformer
from tests.batches import BASE, BY_NAME
from tests.batches.settings import HAS_HF
from tests.conftest import figure
from tests.reference import reference_run

LOSS_ATOL, NORM_ATOL, WEIGHT_ATOL = 5e-6, 2e-6, 3e-5  # tests/test_parity.py's
RESHARD_ATOL = 1e-5  # tests/test_checkpoint.py's
needs_hf = pytest.mark.skipif(not HAS_HF, reason="needs transformers (pip install -e '.[hf]')")
PARITY = [
    "ep2",
    "ep2-dp2",
    "ep4",
    "hsdp-ep2",
    "ep2-one-expert",
    "ep2-lora",
    pytest.param("qwen3-moe-ep2", marks=needs_hf),
]


@pytest.fixture(scope="module")
def runs(batches):
    return batches


@pytest.fixture(scope="module")
def references(runs) -> dict:
    """Each parity run's single-process twin (the same config, one process, the whole batch)."""
    out = {}
    for param in PARITY:
        name = param if isinstance(param, str) else param.values[0]
        if name.startswith("qwen3") and not HAS_HF:
            continue
        runs[name]  # (its launch first: it makes the one-expert base)
        cfg = _config(runs, name)
        initial = None
        if cfg.model.init_from:  # (the one-expert base)
            initial = torch.load(cfg.model.init_from, weights_only=True)
        if cfg.model.pretrained:  # (the Hub-format folder: transformers' own load of it)
            from transformers import AutoModelForCausalLM

            initial = AutoModelForCausalLM.from_pretrained(cfg.model.pretrained).state_dict()
        out[name] = reference_run(cfg, initial=initial)
    return out


def _config(runs, name: str):  # noqa: ANN202 - a fsdp_zero Config
    """Run ``name``'s config, its files under the launch's root."""
    return load_config(None, [a.format(root=runs.root) for a in BY_NAME[name].args])


def _diffs(got: dict, ref: dict) -> tuple[float, float, float]:
    loss = max(abs(got["losses"][s] - ref["losses"][s]) for s in ref["losses"])
    norm = max(abs(got["grad_norms"][s] - ref["grad_norms"][s]) for s in ref["losses"])
    weight = max((got["final"][k] - v).abs().max().item() for k, v in ref["final"].items())
    return loss, norm, weight


@pytest.mark.parametrize("name", PARITY)
def test_expert_parallel_training_matches_one_process(runs, references, name):
    got, ref = runs[name], references[name]
    for key, value in ref["initial"].items():  # the experts' slices make the same whole
        assert torch.equal(got["initial"][key], value), key
    loss, norm, weight = _diffs(got, ref)
    figure(
        f"{name} vs single process: max loss / grad norm / weight diff",
        f"{loss:.1e} / {norm:.1e} / {weight:.1e}",
    )
    assert loss < LOSS_ATOL and norm < NORM_ATOL and weight < WEIGHT_ATOL
    assert sorted(got["grad_norms"]) == sorted(ref["losses"])
    assert ref["losses"][max(ref["losses"])] < ref["losses"][1]  # it learns


def test_the_load_balancing_loss_is_logged_and_in_the_loss(runs, references):
    """moe/aux_loss is logged each step, near 1 (balanced: the routers start near uniform); the
    single-process twin without it trains to other losses (the parity above sees the term)."""
    rows = [r for r in _metrics(runs, "ep2") if "moe/aux_loss" in r]
    assert len(rows) == 8 and all(0.9 < r["moe/aux_loss"] < 1.5 for r in rows)
    cfg = load_config(None, [*BASE, "model.preset=moe_nano", "model.aux_loss_coef=0"])
    without = reference_run(cfg)
    assert abs(without["losses"][1] - references["ep2"]["losses"][1]) > 5e-3


def _metrics(runs, name: str) -> list[dict]:
    path = runs.path(name) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_every_token_routed_to_one_expert_trains_and_matches(runs, references):
    """The top-1 twin's routers start at zero: every score ties and one expert (the one topk picks
    among equals) takes every token of both ranks on the first step, the other ep rank's experts
    none (their gradients are still reduced, their exchanges' backwards still run: no hang). The
    parity above holds; here, that the routing really collapsed."""
    base = torch.load(_config(runs, "ep2-one-expert").model.init_from, weights_only=True)
    router = Router(model_args("moe_nano", experts_top_k=1))
    router.gate.weight.data = base["layers.0.moe.router.gate.weight"]
    _, _, experts = router(torch.randn(64, 64))
    assert experts.unique().numel() == 1
    assert runs["ep2-one-expert"]["losses"][4] < runs["ep2-one-expert"]["losses"][1]


def test_each_rank_holds_its_slice_of_the_experts_sharded_over_the_ranks_ep_leaves(runs):
    """ep 2 x dp 2: rank r holds experts [4 (r % 2), 4 (r % 2) + 4), rows split over the 2 ranks ep
    leaves: 8 / 2 / 2 experts' worth of every expert weight, each (expert, row) block on exactly one
    rank; the expert bytes a rank holds are the formula's 4 P_experts / N (fp32 weights)."""
    shards = runs["ep2-dp2"]["experts"]
    args = model_args("moe_nano")
    experts_numel = 3 * args.n_experts * args.dim * args.expert_width * args.n_layers
    for rank, mine in enumerate(shards):
        assert len(mine) == 3 * args.n_layers
        held = sum(math.prod(shape) for shape, _ in mine.values())
        assert 4 * held == 4 * experts_numel / 4
        for name, (shape, offset) in mine.items():
            assert shape[0] == 2, name  # 8 experts / ep 2 / dp 2
            assert offset[0] // 4 == rank % 2, name  # ep rank: the inner grid axis
    for name in shards[0]:
        starts = sorted(s[name][1][0] for s in shards)
        assert starts == [0, 2, 4, 6], name  # every expert's rows on exactly one rank


def test_the_dispatch_bytes_are_the_routings(runs):
    """Every rank's counted dispatch and combine bytes equal 2 (S + R) dim b from its own routing
    counts (S pairs sent to other ranks, R received), 3 (S + R) dim b where its block is recomputed
    (ep4); the experts' all-gathers are over the ranks ep leaves only (the formula counts them
    there, and the counted all-gathers equal it: no expert weight crosses the ep group)."""
    for name, ratio_max in (("ep2-dp2", 0.65), ("ep4", 0.25), ("ep2", 0.55)):
        summary = json.loads((runs.path(name) / "summary.json").read_text())
        for rank in summary["ranks"]:
            got, formula = rank["comm_bytes"], rank["comm_formula_bytes"]
            assert got["ep_all_to_all"] > 0 and got["ep_all_to_all"] == formula["ep_all_to_all"]
            assert got["all_gather"] == formula["all_gather"]
            assert got["reduce_scatter"] == formula["reduce_scatter"]
        figure(
            f"{name}: all-gathered MiB a step",
            f"{summary['ranks'][0]['comm_bytes']['all_gather'] / 2**20:.3f}",
        )


def test_balanced_routing_sends_about_tokens_topk_times_ep_minus_one_over_ep(runs):
    """Near-uniform routers (the start): ep 2 x dp 2's dispatch bytes a step within 25% of
    4 x tokens x top-k x dim x 4 B x (ep - 1) / ep (forward and backward, both directions)."""
    summary = json.loads((runs.path("ep2-dp2") / "summary.json").read_text())
    args = model_args("moe_nano")
    tokens = 2 * 32  # a rank's micro-batch (one a step)
    expected = 4 * tokens * args.experts_top_k * args.dim * 4 * (1 / 2) * args.n_layers
    for rank in summary["ranks"]:
        assert 0.75 < rank["comm_bytes"]["ep_all_to_all"] / expected < 1.25


@pytest.mark.parametrize("name", ["ep2-to-ep4-n4", "ep2-to-ep1-n1"])
def test_a_checkpoint_moves_between_ep_degrees(runs, name):
    """ep 2's step-4 checkpoint (the full model's names) continued at ep 4 and at one rank: the
    same training as ep 2 straight through, up to the order of reductions."""
    moved, straight = runs[name], runs["ep2"]
    assert sorted(moved["losses"]) == [5, 6, 7, 8]
    for step, loss in moved["losses"].items():
        assert loss == pytest.approx(straight["losses"][step], abs=RESHARD_ATOL), step
    for key, value in straight["final"].items():
        torch.testing.assert_close(moved["final"][key], value, atol=RESHARD_ATOL, rtol=0)


def test_lora_trains_the_adapters_with_the_experts_frozen(runs):
    got = runs["ep2-lora"]
    experts = [k for k in got["initial"] if ".experts." in k]
    assert experts and all(torch.equal(got["final"][k], got["initial"][k]) for k in experts)
    adapters = [k for k in got["final"] if "lora_B" in k]
    assert adapters and any(not torch.equal(got["final"][k], got["initial"][k]) for k in adapters)


@needs_hf
def test_a_hugging_face_mixture_exports_to_a_folder_from_pretrained_loads(runs, tmp_path):
    """qwen3-moe-ep2's step-4 checkpoint (saved at ep 2) exported as a from_pretrained folder: the
    plain class loads it, experts whole, and computes the sharded model's logits."""
    from transformers import Qwen3MoeForCausalLM

    from fsdp_zero.checkpoint.weights import export_checkpoint
    from fsdp_zero.data.batches import build_source
    from fsdp_zero.model.hf import export_files
    from fsdp_zero.model.tasks import logits_of

    ckpt = runs.path("qwen3-moe-ep2") / "checkpoints" / "step-0000004"
    export_checkpoint(ckpt, tmp_path / "hf", extra_files=export_files(ckpt))
    assert (tmp_path / "hf" / "config.json").exists()
    plain = Qwen3MoeForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert plain.model.layers[0].mlp.experts.gate_up_proj.shape[0] == 4
    cfg = _config(runs, "qwen3-moe-ep2")
    inputs = build_source(cfg.data, cfg.train.seed, 101).batch(range(2))[0]
    with torch.no_grad():
        torch.testing.assert_close(
            logits_of(plain(inputs)), runs["qwen3-moe-ep2"]["logits"], atol=1e-5, rtol=0
        )


# --- in-process: the pieces ---------------------------------------------------------------------


def test_ep_is_a_data_parallel_axis_that_joins_fsdp():
    """ep's ranks read different data (the batch counts them) and FSDP shards the dense
    parameters over them; the experts' mesh is the shard group without them."""
    t = Topology.of(ParallelConfig(ep_size=2), 4)
    assert dict(t.sizes) == {"pp": 1, "dp_replicate": 1, "dp_shard": 2, "ep": 2, "sp": 1, "tp": 1}
    assert t.size(Role.BATCH) == 4 and t.size(Role.SHARD) == 4 and t.shard_group == 4
    assert t.rank("ep", 3) == 1 and t.rank("dp_shard", 3) == 1
    hybrid = Topology.of(ParallelConfig(ep_size=2, strategy="hybrid_shard", shard_size=2), 4)
    assert hybrid.replicas == 2 and hybrid.size(Role.BATCH) == 4


def test_bad_expert_parallel_settings_are_refused_in_one_line():
    from fsdp_zero.sharding.experts import check_experts

    with pytest.raises(ValueError, match=r"parallel.ep_size=3 must divide the model's 8 experts"):
        check_experts(Transformer(model_args("moe_nano")), 3)
    with pytest.raises(ValueError, match=r"parallel.ep_size=2: Transformer has no routed experts"):
        check_experts(Transformer(model_args("gpt_nano")), 2)
    for bad, key in (
        (["parallel.pp_size=2"], "parallel.pp_size"),
        (["parallel.tp_size=2"], "parallel.tp_size"),
        (["parallel.strategy=ddp"], "parallel.strategy"),
    ):
        with pytest.raises(ValueError, match=key):
            load_config(None, ["model.preset=moe_nano", "parallel.ep_size=2", *bad])
    with pytest.raises(ValueError, match="model.experts_top_k=9 must be at most model.n_experts=8"):
        load_config(None, ["model.preset=moe_nano", "model.experts_top_k=9"])


def test_the_load_balancing_loss_is_one_when_balanced_and_e_when_collapsed():
    moe = {"num_experts": 4, "num_experts_per_tok": 1, "scoring_func": "softmax"}
    # each of 4 tokens to its own expert, with every score uniform: 1
    uniform = torch.zeros(4, 4) + torch.eye(4) * 1e-3
    assert load_balance_loss((uniform,), moe, 1).item() == pytest.approx(1.0, abs=1e-3)
    # every token to expert 0 with all its score there: E
    collapsed = torch.full((4, 4), -1e4)
    collapsed[:, 0] = 0
    assert load_balance_loss((collapsed,), moe, 1).item() == pytest.approx(4.0)
    # per sequence: a batch's is the mean of its sequences'
    a, b = torch.randn(8, 4), torch.randn(8, 4)
    both = load_balance_loss((torch.cat([a, b]),), moe, 2)
    halves = (load_balance_loss((a,), moe, 1) + load_balance_loss((b,), moe, 1)) / 2
    assert both.item() == pytest.approx(halves.item(), abs=1e-7)


def test_capacity_drops_the_later_tokens_of_a_full_expert():
    args = model_args("moe_nano", experts_top_k=1, capacity_factor=1.0)
    router = Router(args)
    with torch.no_grad():
        router.gate.weight.zero_()  # every token ties: one expert for all
    _, _, experts = router(torch.randn(16, 64))
    # capacity ceil(1.0 x 16 x 1 / 8) = 2: the first two kept, the rest no expert (index 8)
    first = experts[0, 0].item()
    assert first < 8 and experts.flatten().tolist() == [first, first] + [8] * 14


def test_the_presets_active_and_total_parameters():
    small, nano = model_args("moe_small"), model_args("moe_nano")
    assert small.num_params(active=True) == pytest.approx(
        model_args("gpt_small").num_params(), rel=1e-3
    )
    assert small.num_params() > 2 * small.num_params(active=True)
    model = Transformer(nano)
    assert sum(p.numel() for p in model.parameters()) == nano.num_params()


def test_the_planner_simulates_expert_parallelism_and_matches_the_run(runs):
    """plan.py simulate of ep 1, 2 and 4 at 4 ranks (a balanced router: fake tensors carry no data
    to route by): the same model state, which the ep 2 x dp 2 run measured; the gathered
    parameters at the peak fall as ep grows (each rank gathers its share of the experts), and the
    all-gather formula is what the run counted."""
    from fsdp_zero.config.strategies import Strategy
    from fsdp_zero.tools.planner import simulate

    preds = {}
    for ep in (1, 2, 4):
        cfg = load_config(None, [*BASE, "model.preset=moe_nano", f"parallel.ep_size={ep}"])
        (preds[ep],) = simulate(cfg, 4, [Strategy.full_shard])
    run = runs["ep2-dp2"]
    assert preds[2].model_state == pytest.approx(run["model_state_bytes"][0], rel=0.01)
    assert preds[1].model_state == pytest.approx(preds[2].model_state, rel=1e-3)
    gathered = [preds[ep].tensors["gathered_params"] for ep in (1, 2, 4)]
    assert gathered[0] > gathered[1] > gathered[2]
    figure(
        "moe_nano at 4 ranks: simulated gathered MiB at ep 1 / 2 / 4",
        " / ".join(f"{g / 2**20:.2f}" for g in gathered),
    )


def test_the_fit_keeps_a_given_ep_and_prices_its_dispatch():
    """plan.py fit with parallel.ep_size=2: every candidate keeps ep 2, simulated as it is (not
    composed by formula), and its communication has the balanced router's dispatch bytes."""
    from fsdp_zero.model.construct import construct
    from fsdp_zero.monitor.comm import comm_formula
    from fsdp_zero.sharding.precision import resolve_precision
    from fsdp_zero.sharding.wrap import build_wrap_plan
    from fsdp_zero.tools.candidates import Candidate

    cfg = load_config(None, [*BASE, "model.preset=moe_nano", "parallel.ep_size=2"])
    assert not Candidate.layered.fget(SimpleNamespace(split=(("ep", 2), ("sp", 1), ("tp", 1))))
    model = construct(cfg.model)
    topology = Topology.of(cfg.parallel, 4)
    plan = build_wrap_plan(model, cfg.parallel.wrap, topology.param_shards)
    moved = comm_formula(
        cfg, topology, model, plan, accum=1, precision=resolve_precision(cfg.precision)
    )
    args = model_args("moe_nano")
    # 2 layers x 2 (forward and backward) x (S + R) x dim x 4 B, S = R = 64 tokens x 2 x 1/2
    assert moved.ep_all_to_all == 2 * 2 * 2 * 64 * args.dim * 4


@needs_hf
@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_a_hub_checkpoints_expert_by_expert_weights_load_stacked(kind, tmp_path):
    """transformers 5 saves a mixture's experts one Linear each (the Hub's format: Qwen3-MoE's
    experts.<e>.gate_proj/up_proj/down_proj, Mixtral's w1/w3/w2) and holds them stacked; the
    weights a run starts from (model.pretrained) read them stacked, each expert's gate and up rows
    joined, and every other tensor under transformers 5's names, equal to what from_pretrained
    holds."""
    import transformers

    from fsdp_zero.model.source import FullWeights

    small = dict(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2)
    small |= dict(num_key_value_heads=1, head_dim=8, num_experts_per_tok=2)
    if kind == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**small, num_experts=4, moe_intermediate_size=8)
        cls = transformers.Qwen3MoeForCausalLM
    else:
        config = transformers.MixtralConfig(**small, num_local_experts=4, intermediate_size=8)
        cls = transformers.MixtralForCausalLM
    torch.manual_seed(0)
    cls(config).save_pretrained(tmp_path)
    weights = FullWeights(tmp_path / "model.safetensors")
    held = cls.from_pretrained(tmp_path).state_dict()
    stacked = [
        n for n in weights.shapes if n.endswith(("experts.gate_up_proj", "experts.down_proj"))
    ]
    assert len(stacked) == 2 and not any(".experts.0." in n for n in weights.shapes)
    for name in stacked:
        assert torch.equal(weights.rows(name, 1, 3), held[name][1:3]), name
    # every tensor under transformers 5's names (Mixtral's block_sparse_moe is its mlp), the same
    assert set(held) - {"lm_head.weight"} <= set(weights.shapes)
    for name in set(held) & set(weights.shapes):
        rows = held[name].shape[0] if held[name].dim() else 0
        assert torch.equal(weights.rows(name, 0, rows), held[name]), name
