"""What a run is: the schema, the strategy table, the loader and the DeepSpeed reader (torch-free)."""

from fsdp_zero.config.choices import Quantize
from fsdp_zero.config.constraints import field_constraint
from fsdp_zero.config.deepspeed import mapping_table, read_deepspeed
from fsdp_zero.config.loader import load_config, read_saved_config, to_yaml
from fsdp_zero.config.lora import LoRAConfig
from fsdp_zero.config.paths import CONFIG_FILE, STATE_FILE, RunDir
from fsdp_zero.config.presets import (
    BUILTIN_FIELDS,
    PRESETS,
    TransformerArgs,
    check_model_config,
    model_args,
)
from fsdp_zero.config.rules import refusal_matrix, validate

# the choices' enums come through the schema, whose fields they type (config/choices.py)
from fsdp_zero.config.schema import (
    TOKEN_SOURCES,
    ActivationCheckpointing,
    Backend,
    Config,
    DataConfig,
    DataSource,
    Device,
    DistConfig,
    Init,
    ModelConfig,
    OffloadConfig,
    OptimConfig,
    OptimizerImpl,
    ParallelConfig,
    PrecisionConfig,
    Schedule,
    StateTier,
    Task,
    TrainConfig,
    WrapConfig,
    WrapPolicy,
)
from fsdp_zero.config.strategies import (
    STRATEGIES,
    STRATEGY_ALIASES,
    ZERO_STAGES,
    GradSync,
    Strategy,
    StrategySpec,
    is_fsdp,
)
from fsdp_zero.config.targets import import_target

__all__ = [
    "ActivationCheckpointing",
    "Backend",
    "BUILTIN_FIELDS",
    "check_model_config",
    "Config",
    "CONFIG_FILE",
    "DataConfig",
    "DataSource",
    "Device",
    "DistConfig",
    "field_constraint",
    "GradSync",
    "import_target",
    "Init",
    "is_fsdp",
    "load_config",
    "LoRAConfig",
    "mapping_table",
    "model_args",
    "ModelConfig",
    "OffloadConfig",
    "OptimConfig",
    "OptimizerImpl",
    "ParallelConfig",
    "PrecisionConfig",
    "Quantize",
    "PRESETS",
    "read_deepspeed",
    "read_saved_config",
    "refusal_matrix",
    "RunDir",
    "Schedule",
    "StateTier",
    "STATE_FILE",
    "STRATEGIES",
    "Strategy",
    "STRATEGY_ALIASES",
    "StrategySpec",
    "Task",
    "to_yaml",
    "TOKEN_SOURCES",
    "TrainConfig",
    "TransformerArgs",
    "validate",
    "WrapConfig",
    "WrapPolicy",
    "ZERO_STAGES",
]
