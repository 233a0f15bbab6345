"""Wrap plans on the built-in model and on models that declare no block (meta device: no memory, no process group).

Covers: fsdp_zero/sharding/wrap.py
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fsdp_zero.config.choices import WrapPolicy
from fsdp_zero.config.presets import model_args
from fsdp_zero.config.schema import WrapConfig
from fsdp_zero.sharding.wrap import build_wrap_plan
from tests.conftest import build_model


def nano(**kw):
    return build_model(model_args("gpt_nano", **kw))


def units(plan):
    return [u.fqn for u in plan.units]


def test_transformer_policy_wraps_each_block_then_root():
    plan = build_wrap_plan(nano(), WrapConfig(), shards=2)
    assert units(plan) == ["layers.0", "layers.1", ""]
    model = nano()
    assert sum(u.num_params for u in plan.units) == sum(p.numel() for p in model.parameters())
    block = sum(p.numel() for p in model.layers["0"].parameters())
    assert plan.units[0].num_params == block
    assert plan.units[0].full_bytes == 4 * block
    assert plan.units[0].bytes_per_rank == 2 * block  # every dim-0 size of nano divides by 2


def test_transformer_policy_with_explicit_classes_bottom_up():
    plan = build_wrap_plan(
        nano(), WrapConfig(classes=["TransformerBlock", "FeedForward"]), shards=2
    )
    assert units(plan) == [
        "layers.0.feed_forward",
        "layers.1.feed_forward",
        "layers.0",
        "layers.1",
        "",
    ]


def test_unknown_class_lists_the_model_classes():
    with pytest.raises(
        ValueError, match=r"parallel\.wrap\.classes: unknown module class 'Block'.*TransformerBlock"
    ):
        build_wrap_plan(nano(), WrapConfig(classes=["Block"]), shards=2)


def test_size_based_follows_fsdp1_semantics():
    # Attention holds 16,384 and FeedForward 36,864 parameters in gpt_nano: with a
    # threshold of 20,000 only the feed-forwards qualify; each block then keeps
    # attention + norms (16,512) < 20,000, so blocks are not units; the embeddings
    # (16,384 each) are not either.
    plan = build_wrap_plan(
        nano(), WrapConfig(policy=WrapPolicy.size_based, min_params=20_000), shards=2
    )
    assert units(plan) == ["layers.0.feed_forward", "layers.1.feed_forward", ""]
    plan = build_wrap_plan(
        nano(), WrapConfig(policy=WrapPolicy.size_based, min_params=16_000), shards=2
    )
    assert units(plan) == [
        "layers.0.attention",
        "layers.0.feed_forward",
        "layers.1.attention",
        "layers.1.feed_forward",
        "tok_embeddings",
        "output",
        "",
    ]


def test_size_based_that_matches_nothing_is_an_error():
    with pytest.raises(
        ValueError, match=r"parallel\.wrap\.min_params=10,000,000 matches no module.*53,376"
    ):
        build_wrap_plan(
            nano(), WrapConfig(policy=WrapPolicy.size_based, min_params=10_000_000), shards=2
        )


def test_modules_policy_by_regex():
    plan = build_wrap_plan(
        nano(),
        WrapConfig(policy=WrapPolicy.modules, modules=[r"layers\.\d+\.attention", "output"]),
        4,
    )
    assert units(plan) == ["layers.0.attention", "layers.1.attention", "output", ""]


def test_modules_policy_errors():
    cfg = WrapConfig(policy=WrapPolicy.modules, modules=["layers.9"])
    with pytest.raises(ValueError, match=r"parallel\.wrap\.modules: .*matches no module"):
        build_wrap_plan(nano(), cfg, shards=2)
    with pytest.raises(
        ValueError,
        match=r"parallel\.wrap\.modules: 'layers\.\(' is not a valid regular expression \(",
    ):
        WrapConfig(policy=WrapPolicy.modules, modules=["layers.("]).check()


def test_none_policy_is_root_only():
    plan = build_wrap_plan(nano(), WrapConfig(policy=WrapPolicy.none), shards=2)
    assert units(plan) == [""]
    assert plan.units[0].num_params == sum(p.numel() for p in nano().parameters())


def test_tied_embeddings_stay_in_one_unit():
    model = nano(tie_embeddings=True)
    plan = build_wrap_plan(
        model,
        WrapConfig(policy=WrapPolicy.modules, modules=["output", "tok_embeddings", r"layers\.\d+"]),
        2,
    )
    assert units(plan) == ["layers.0", "layers.1", ""]
    assert any("shares" in n for n in plan.notes)
    # The shared weight is counted once, in the root.
    assert sum(u.num_params for u in plan.units) == sum(p.numel() for p in model.parameters())


def test_plan_table_lists_units_and_bytes():
    table = build_wrap_plan(nano(), WrapConfig(), shards=4).table()
    assert "policy=transformer" in table and "<root>" in table and "MiB/rank (N=4)" in table
    assert table.count("TransformerBlock") == 2


def test_containers_are_not_units():
    with pytest.raises(ValueError, match=r"'layers' is a ModuleDict, a container"):
        build_wrap_plan(nano(), WrapConfig(policy=WrapPolicy.modules, modules=["layers"]), shards=2)


def test_a_model_that_declares_no_block_wraps_the_class_its_outermost_list_repeats():
    """A user's own GPT (tests/user_gpt.py: no _no_split_modules, no block_class): its blocks are the class
    that its ModuleList repeats; a list nested in those blocks (an attention's heads) is not searched, a
    list of mixed classes is not a stack of blocks, and the plan's note names what was found and the key
    that overrides it."""
    from tests.user_gpt import GPT

    class Heads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.heads = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.ModuleList([nn.Linear(4, 4), nn.LayerNorm(4)])  # mixed: not blocks
            self.body = nn.Sequential(Heads(), Heads())

    with torch.device("meta"):
        gpt, nested = GPT(depth=3), Model()
    plan = build_wrap_plan(gpt, WrapConfig(), shards=2)
    assert (
        units(plan) == ["blocks.0", "blocks.1", "blocks.2", ""]
        and plan.block_fqns == units(plan)[:3]
    )
    assert plan.notes == [
        "blocks found, not declared: Block, repeated in blocks (3); to wrap other classes, set "
        "parallel.wrap.classes (e.g. parallel.wrap.classes=[Block])"
    ]
    assert "note: blocks found, not declared: Block" in plan.table()
    assert units(build_wrap_plan(nested, WrapConfig(), shards=2)) == ["body.0", "body.1", ""]
    # a declared class, or one named in parallel.wrap.classes, is taken as it is: nothing found, no note
    assert not build_wrap_plan(nano(), WrapConfig(), shards=2).notes
    named = build_wrap_plan(gpt, WrapConfig(classes=["Attention"]), shards=2)
    assert (
        named.block_fqns == ["blocks.0.attn", "blocks.1.attn", "blocks.2.attn"] and not named.notes
    )
