"""What is trained: construction, the built-in transformer, tasks, initialisation, LoRA, Hugging Face in."""

from fsdp_zero.model.construct import construct, meta_parameters, real_buffers
from fsdp_zero.model.contract import (
    DECLARED,
    FsdpZeroModel,
    ModelFacts,
    contract_table,
    model_facts,
)
from fsdp_zero.model.hf import INDEX_FILE, SINGLE_FILE, export_files, run_dir_files, weights_path
from fsdp_zero.model.init import local_rows
from fsdp_zero.model.lora import (
    ADAPTER_FILES,
    LoRALinear,
    adapter_names,
    export_plan,
    frozen_count,
    init_adapters,
    make_trainable,
)
from fsdp_zero.model.source import FullWeights, base_source, match_weights
from fsdp_zero.model.tasks import (
    TASKS,
    LossFn,
    build_task,
    check_classes_fit,
    logits_of,
    max_seq_len,
    num_outputs,
    to_device,
    trained_tokens,
    vocab_size,
)

# The built-in model and its blocks (the class names `parallel.wrap.classes` takes).
from fsdp_zero.model.transformer import Attention, FeedForward, Transformer, TransformerBlock

__all__ = [
    "Attention",
    "FeedForward",
    "TransformerBlock",
    "ADAPTER_FILES",
    "base_source",
    "adapter_names",
    "build_task",
    "check_classes_fit",
    "construct",
    "contract_table",
    "DECLARED",
    "FsdpZeroModel",
    "model_facts",
    "ModelFacts",
    "export_files",
    "export_plan",
    "frozen_count",
    "FullWeights",
    "INDEX_FILE",
    "init_adapters",
    "local_rows",
    "logits_of",
    "LoRALinear",
    "LossFn",
    "make_trainable",
    "match_weights",
    "max_seq_len",
    "meta_parameters",
    "num_outputs",
    "real_buffers",
    "run_dir_files",
    "SINGLE_FILE",
    "TASKS",
    "to_device",
    "trained_tokens",
    "Transformer",
    "vocab_size",
    "weights_path",
]
