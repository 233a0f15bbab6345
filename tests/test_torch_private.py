"""The private torch and torchao APIs we use are where we expect them: an upgrade that moves one fails
here, by name, not somewhere deep in a run.

Covers: fsdp_zero/torch_private.py
"""

from __future__ import annotations

import re

import pytest
import torch

from tests.batches import HAS_HF
from tests.conftest import REPO


def test_private_torch_apis_are_where_we_expect_them():
    """fsdp_zero.torch_private imports every private torch API we use; a torch upgrade that moves
    one fails here, by name, not somewhere deep in a run."""
    import inspect

    from fsdp_zero import torch_private

    assert callable(torch_private._init_optim_state)
    # expert parallelism's: the graph task id (-1 outside backward), a module's _parameters
    assert not torch_private.in_backward() and torch._C._current_graph_task_id() == -1
    linear = torch.nn.Linear(2, 2)
    with torch_private.local_parameters(linear) as local:
        assert "weight" not in linear._parameters and linear.weight is local[0]
    assert isinstance(linear._parameters["weight"], torch.nn.Parameter)
    assert "optim" in inspect.signature(torch_private._init_optim_state).parameters
    from torch.distributed.fsdp import FSDPModule

    assert hasattr(FSDPModule, "set_custom_reduce_scatter")
    assert inspect.signature(torch_private.DefaultReduceScatter.__call__).parameters.keys() >= {
        "output_tensor",
        "input_tensor",
        "group",
        "op",
        "async_op",
    }
    assert hasattr(FSDPModule, "set_custom_all_gather") and hasattr(
        FSDPModule, "set_all_reduce_hook"
    )
    assert inspect.signature(torch_private.DefaultAllGather.__call__).parameters.keys() >= {
        "output_tensor",
        "input_tensor",
        "group",
        "async_op",
    }
    # what count_zero_broadcasts wraps and reads
    from torch.distributed.optim import ZeroRedundancyOptimizer

    assert hasattr(ZeroRedundancyOptimizer, "_partition_parameters")
    assert (
        "rank" in inspect.signature(ZeroRedundancyOptimizer._broadcast_params_from_rank).parameters
    )
    # what skips_on_device reads: fused AdamW says it takes GradScaler's found_inf, foreach does not
    w = [torch.nn.Parameter(torch.ones(2))]
    assert torch_private.skips_on_device(torch.optim.AdamW(w, fused=True))
    assert not torch_private.skips_on_device(torch.optim.AdamW(w, foreach=True))
    # pybind: no inspectable signature
    assert "backend" in torch_private.flight_recorder_json.__doc__
    assert callable(torch_private.default_store)
    # The pinned torch has both public APIs the shims stand in for on the GPU machines' torch 2.11.
    assert torch_private.set_group_timeout is torch.distributed.set_timeout
    assert callable(getattr(FSDPModule, "reset_iter_state", None))
    assert torch_private.FakeStore() is not None
    assert torch_private.FakeTensorMode is not None
    # a saved tensor's storage on the meta device, a DTensor's local part (plan.py's activations)
    base = torch.empty(4, 8, device="meta")
    assert torch_private.storage_key(base.t())[0] == torch_private.storage_key(base)[0]
    assert torch_private.storage_key(base)[0] != torch_private.storage_key(base.clone())[0]
    assert torch_private.storage_key(base)[1] == 4 * 8 * 4
    # the pipeline schedules' action tables, read from stand-in stages (plan.py's activations)
    assert torch_private.schedule_order("1F1B", 2, [0], 4, 0) is None
    order = torch_private.schedule_order("Interleaved1F1B", 2, [0, 2], 4, 0)
    assert order[:4] == [(0, "F", 0), (0, "F", 1), (2, "F", 0), (2, "F", 1)] and len(order) == 16
    assert {k for _, k, _ in torch_private.schedule_order("ZBVZeroBubble", 2, [0, 3], 4, 0)} == {
        "F",
        "I",
        "W",
    }
    # what real_post_forward_meshes wraps
    from torch.distributed.fsdp._fully_shard import _fully_shard

    assert (
        "reshard_after_forward"
        in inspect.signature(_fully_shard._get_post_forward_mesh_info).parameters
    )
    assert {"track_external", "get_tracker_snapshot", "reset_mod_stats"} <= set(
        dir(torch_private.mem_tracker())
    )
    assert issubclass(torch_private.fsdp_mem_tracker(), torch_private.mem_tracker())
    assert issubclass(torch.nn.Conv2d, torch_private.ConvNd) and issubclass(
        torch.nn.BatchNorm1d, torch_private.NormBase
    )
    import importlib

    # what the checkpoint reader's unpickler admits
    for module, name in torch_private.DCP_METADATA_PRIVATE:
        assert hasattr(importlib.import_module(module), name), f"{module}.{name}"
    if HAS_HF:
        from transformers import LlamaConfig, LlamaForCausalLM

        llama = LlamaForCausalLM(
            LlamaConfig(
                hidden_size=16,
                intermediate_size=32,
                num_hidden_layers=1,
                num_attention_heads=2,
                num_key_value_heads=2,
                vocab_size=64,
            )
        )
        assert torch_private.hf_no_split_modules(llama) == ["LlamaDecoderLayer"]
        before = llama.lm_head.weight.detach().clone()
        assert torch_private.hf_init_weights(llama, 0) and not torch.equal(
            before, llama.lm_head.weight
        )
    assert (
        not torch_private.hf_init_weights(torch.nn.Linear(2, 2), 0)
        and torch_private.hf_no_split_modules(torch.nn.Linear(2, 2)) == []
    )
    # No other module imports a private torch or OmegaConf name, or reaches one through attributes.
    import ast

    outside = set()
    for path in (REPO / "fsdp_zero").rglob("*.py"):
        name = path.relative_to(REPO / "fsdp_zero").as_posix()
        if name == "torch_private.py":
            continue
        for line in path.read_text().splitlines():
            if line.lstrip().startswith(("import torch", "from torch", "from omegaconf")):
                assert "._" not in line.split(" import ")[0] and " import _" not in line, (
                    f"{name}: {line}"
                )
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                base = ast.unparse(node.value)
                assert not base.startswith(("torch", "nn.")) and node.attr not in (
                    "_get_node",
                    "_value",
                ), f"{name}: {base}.{node.attr}"
                if base not in ("self", "cls"):
                    outside.add(f"{name}: {base}.{node.attr}")
            if (
                isinstance(node, ast.Call)
                and getattr(node.func, "id", None) in ("getattr", "hasattr", "setattr")
                and isinstance(node.args[1], ast.Constant)
                and re.match(r"_[A-Za-z]", str(node.args[1].value))
            ):
                outside.add(f"{name}: '{node.args[1].value}'")  # getattr(x, "_private")
    # Only our own private names (a data source's memory map) and os._exit remain outside.
    assert outside == {"data/batches.py: '_mapped'", "distributed/env.py: os._exit"}, outside


def test_the_torchao_apis_we_use_are_where_we_expect_them():
    """fsdp_zero.torch_private imports torchao's APIs on first use (the lowbit extra): an upgrade that
    moves one fails here, by name, not in a run's set-up."""
    pytest.importorskip("torchao")
    import importlib

    import torch._functorch.config as functorch_config

    assert hasattr(functorch_config, "enable_autograd_cache")
    wanted = {
        "torchao.quantization": ["quantize_", "to_nf4", "NF4Tensor"],
        "torchao.optim": ["AdamW8bit", "AdamW4bit"],
        "torchao.float8": [
            "Float8LinearConfig",
            "convert_to_float8_training",
            "precompute_float8_dynamic_scale_for_fsdp",
        ],
        "torchao.prototype.moe_training.config": ["MXFP8TrainingOpConfig", "MXFP8TrainingRecipe"],
    }
    for module, names in wanted.items():
        found = importlib.import_module(module)
        assert all(hasattr(found, n) for n in names), (
            module,
            [n for n in names if not hasattr(found, n)],
        )
    from torchao.prototype.moe_training.config import MXFP8TrainingRecipe

    assert {"MXFP8_RCEIL", "MXFP8_EMULATED_RCEIL"} <= set(MXFP8TrainingRecipe.__members__)
