"""A model's tensor-parallel and pipeline plans, on the meta device (single process): what a plan
reaches, what it refuses in one line, and what each pipeline stage holds.

Covers: fsdp_zero/sharding/tensor.py, fsdp_zero/sharding/pipeline.py, fsdp_zero/model/contract.py
"""

from __future__ import annotations

import copy

import pytest
import torch

from fsdp_zero.config.loader import load_config
from fsdp_zero.model.construct import construct
from tests.batches import BY_NAME, HAS_HF, run_config

needs_hf = pytest.mark.skipif(not HAS_HF, reason="needs transformers (pip install -e '.[hf]')")


@needs_hf
def test_a_tensor_parallel_plan_the_model_cannot_take_is_one_line():
    """Checked when the model is built, before anything is split: a split dimension or a head count
    that tp does not divide, a weight the plan would split twice (tied embeddings), no plan at all."""
    from fsdp_zero.sharding.tensor import _check_splits, _expand, tp_plan

    def check_llama(overrides: list[str], tp: int, message: str) -> None:
        model = construct(load_config(None, [*BY_NAME["llama"].args, *overrides]).model)
        with pytest.raises(ValueError, match=message):
            _check_splits(model, _expand(model, tp_plan(model), False), tp)

    check_llama(
        [],
        2,
        r"model\.embed_tokens\.weight \(101, 32\): dimension 0 must be a multiple of "
        r"parallel\.tp_size=2 \(embedding_rowwise\)",
    )
    check_llama(
        ["model.kwargs.vocab_size=102"],
        2,
        r"parallel\.tp_size=2: model\.embed_tokens\.weight and lm_head\.weight are one weight "
        r"\(tied embeddings\)",
    )
    check_llama(
        ["model.kwargs.vocab_size=104"],
        4,
        r"model\.kwargs\.num_key_value_heads=2 must be a multiple of parallel\.tp_size=4",
    )
    with pytest.raises(ValueError, match=r"VisionTransformer declares no tensor-parallel plan"):
        tp_plan(construct(run_config("vit").model))


def test_the_tensor_parallel_plan_reaches_every_layer_of_twelve():
    """A plan pattern's ``*`` is one name component, whatever its length: on gpt_nano with 12
    layers, ``layers.10`` and ``layers.11`` are planned as ``layers.0`` is (no error would say
    otherwise: every pattern still matches some module), and the plan splits every Linear weight
    and the embedding, counted by module type."""
    from fsdp_zero.sharding.tensor import resolve_plan, split_weights

    with torch.device("meta"):
        model = construct(load_config(None, ["model.preset=gpt_nano", "model.n_layers=12"]).model)
    for sp, per_layer in ((True, 11), (False, 7)):  # 7 Linears; with sp 2 norms and 2 gathers
        planned, _ = resolve_plan(model, sp)
        layers = [fqn.split(".")[1] for fqn in planned if fqn.startswith("layers.")]
        assert {i: layers.count(str(i)) for i in range(12)} == dict.fromkeys(range(12), per_layer)
        assert len(layers) == 12 * per_layer, sorted(set(layers))
    by_type = sum(
        m.weight.numel()
        for m in model.modules()
        if isinstance(m, (torch.nn.Linear, torch.nn.Embedding))
    )
    assert sum(isinstance(m, torch.nn.Linear) for m in model.modules()) == 12 * 7 + 1  # the head
    assert split_weights(model, True) == split_weights(model, False) == by_type


def test_each_pipeline_stage_holds_its_own_layers_under_their_full_names():
    """The built-in model cut for pp 2 x 2 stages a rank under the V schedule (rank 0: stages 0 and
    3) and the loop (rank 0: stages 0 and 2): each stage its run of layers, the embedding on the
    first, the norm and head on the last, nothing else (never the whole model); the rank's view
    holds exactly its stages' parameters, the same objects, under the full model's names. Layers
    the stages do not divide go one each to the first stages, none left out. A model without a
    pipeline plan is one line."""
    from fsdp_zero.config.schema import ParallelConfig
    from fsdp_zero.distributed import Topology
    from fsdp_zero.sharding.pipeline import build_stages, cut_rank, num_stages, pp_plan

    with torch.device("meta"):
        model = construct(load_config(None, ["model.preset=gpt_nano", "model.n_layers=4"]).model)
    names = {n for n, _ in model.named_parameters()}
    for schedule, want in (
        ("ZBVZeroBubble", [["tok_embeddings", "layers.0"], ["layers.3", "norm", "output"]]),
        ("Interleaved1F1B", [["tok_embeddings", "layers.0"], ["layers.2"]]),
    ):
        par = ParallelConfig(pp_size=2, pp_schedule=schedule)
        topology = Topology.of(par, 2)
        stages = build_stages(model, par, topology, 0, torch.device("cpu"), lambda m: (m, None))
        held = [sorted({_top(n) for n, _ in part.named_parameters()}) for part in stages.parts]
        assert held == [sorted(w) for w in want], (schedule, held)
        view = dict(stages.model.named_parameters())
        parts = {n: p for part in stages.parts for n, p in part.named_parameters()}
        assert view.keys() == parts.keys() < names
        assert all(view[n] is parts[n] for n in view)
        with pytest.raises(RuntimeError, match="not called"):
            stages.model(torch.zeros(1, 4, dtype=torch.long))
    # Layers that the stages do not divide (config.rules asks only for n_layers >= stages): the
    # first stages take one more each, and every layer is on a stage, in order (3 at pp 2; 5 over
    # pp 2 x 2 stages a rank, Interleaved1F1B: rank 0 holds stages 0 and 2, rank 1 stages 1 and 3).
    for n_layers, schedule, runs in (
        (3, "1F1B", [[0, 1], [2]]),
        (5, "Interleaved1F1B", [[0, 1], [2], [3], [4]]),
    ):
        with torch.device("meta"):
            uneven = construct(
                load_config(None, ["model.preset=gpt_nano", f"model.n_layers={n_layers}"]).model
            )
        par = ParallelConfig(pp_size=2, pp_schedule=schedule)
        cut = dict(s for r in range(2) for s in cut_rank(uneven, par, r))
        held = [[int(name) for name in cut[s].layers] for s in range(num_stages(par))]
        assert held == runs, (schedule, held)
    with pytest.raises(ValueError, match=r"VisionTransformer declares no pipeline plan"):
        pp_plan(construct(run_config("vit").model))
    # what cannot be cut, whatever the model: a parameter on two stages, blocks without names
    par = ParallelConfig(pp_size=2)
    with torch.device("meta"):
        tied = construct(
            load_config(None, ["model.preset=gpt_nano", "model.tie_embeddings=true"]).model
        )
    with pytest.raises(
        ValueError,
        match=r"tok_embeddings\.weight and output\.weight are one parameter on different pipeline",
    ):
        cut_rank(tied, par, 0)
    listed = copy.deepcopy(model)
    listed.layers = torch.nn.ModuleList(listed.layers.values())
    with pytest.raises(ValueError, match=r"layers is a ModuleList; .* an nn\.ModuleDict"):
        cut_rank(listed, par, 0)


def _top(name: str) -> str:
    """A parameter's top-level module: a layer (layers.3) or a part (output)."""
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "layers" else parts[0]
