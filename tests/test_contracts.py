"""The two contracts: what a model may declare (one protocol, read in one module) and what a
checkpoint holds (a mapping of Stateful parts, the optimizer's chosen where the optimizer is built).

Covers: fsdp_zero/model/contract.py, fsdp_zero/checkpoint/parts.py
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful

from fsdp_zero.checkpoint import training_parts
from fsdp_zero.config import ModelConfig
from fsdp_zero.model import DECLARED, FsdpZeroModel, ModelFacts, construct, model_facts


def test_the_table_names_each_member_the_protocol_declares():
    members = set(FsdpZeroModel.__annotations__) | {"init_weights(seed)", "get_output_embeddings()"}
    assert {d.name for d in DECLARED} == members


def test_the_built_in_model_declares_every_member_and_a_plain_module_none():
    model = construct(ModelConfig(preset="gpt_nano"))
    facts = model_facts(model)
    assert isinstance(facts, ModelFacts)
    assert facts.block_class.__name__ == "TransformerBlock"
    assert facts.tp_plan and set(facts.pp_plan) == {"first", "layers", "last"}
    assert facts.sp_plan == ("layers.*.attention.core",)
    assert facts.attention == {
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "head_dim": 16,
    }
    assert facts.init_weights is not None and facts.max_seq_len == model.args.max_seq_len
    assert facts.head is model.output
    plain = model_facts(nn.Linear(2, 2))
    assert plain == ModelFacts(
        block_class=None,
        no_split_modules=[],
        tp_plan=None,
        pp_plan=None,
        sp_plan=None,
        ep_plan=(),
        moe=None,
        init_weights=None,
        max_seq_len=None,
        vocab_size=None,
        initializer_range=None,
        head_counts={"num_attention_heads": None, "num_key_value_heads": None},
        head=None,
        attention=None,
    )


def test_a_hugging_face_config_is_read_for_what_the_model_does_not_say():
    class Config:
        vocab_size, max_position_embeddings, initializer_range = 50, 64, 0.01
        num_attention_heads = 4

    class Model(nn.Module):
        _no_split_modules = ["Block"]

        def __init__(self) -> None:
            super().__init__()
            self.config = Config()

    facts = model_facts(Model())
    assert (facts.vocab_size, facts.max_seq_len, facts.initializer_range) == (50, 64, 0.01)
    assert facts.head_counts == {"num_attention_heads": 4, "num_key_value_heads": None}
    assert facts.no_split_modules == ["Block"]
    assert facts.attention is None  # (no layers, no width: sequence parallelism is refused)
    Config.num_hidden_layers, Config.hidden_size = 3, 32
    assert model_facts(Model()).attention == {
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "head_dim": 8,
    }


def test_a_checkpoint_is_its_parts_model_first():
    model = nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    parts = training_parts(model, optimizer, rebuilt=frozenset({"bias"}))
    assert list(parts) == ["model", "optim"]
    assert all(isinstance(p, Stateful) for p in parts.values())
    assert set(parts["model"].state_dict()) == {"weight"}  # the rebuilt tensors left out
    assert set(parts["optim"].state_dict()) == {"weight", "bias"}  # keyed by FQN
    assert parts["model"].known_keys() is None
