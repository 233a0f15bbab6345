"""A DeepSpeed JSON config's mistakes are one-line errors naming the key: unknown keys, unsupported
values and contradictions, and a value of the wrong kind (NaN, 1e400, a bool or a string where a
number goes, except where DeepSpeed reads strings as numbers: tests/test_deepspeed.py).

Covers: fsdp_zero/config/deepspeed.py, fsdp_zero/config/ds_values.py
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fsdp_zero.config.deepspeed import read_deepspeed


def _read(tmp_path: Path, ds: dict) -> tuple[list[str], list[str]]:
    return _read_text(tmp_path, json.dumps(ds))


def _read_text(tmp_path: Path, text: str) -> tuple[list[str], list[str]]:
    """As `_read`, from the JSON text as written (json.dumps cannot write 1e400); at 2 ranks."""
    path = tmp_path / "ds_config.json"
    path.write_text(text)
    return read_deepspeed(path, 2)


@pytest.mark.parametrize(
    "ds, message",
    [
        ({"train_batchsize": 8}, "ds_config train_batchsize=8: unknown DeepSpeed key"),
        (
            {"zero_optimization": {"stagee": 3}},
            "ds_config zero_optimization.stagee=3: unknown DeepSpeed key; keys of "
            "'zero_optimization' read here: zero_optimization.stage",
        ),
        (
            {"zero_optimization": {"stage": 4}},
            "ds_config zero_optimization.stage=4: valid choices: 0, 1, 2, 3",
        ),
        (
            {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}},
            "ds_config zero_optimization.offload_param.device='nvme': parameters on disk are not "
            "supported under FSDP2, which all-gathers each unit from its resident shard "
            "(docs/deepspeed.md); valid choices: cpu, none",
        ),
        (
            {"zero_optimization": {"stage": 3, "offload_param": {"device": "gpu"}}},
            "ds_config zero_optimization.offload_param.device='gpu': valid choices: cpu, none",
        ),
        (
            {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"}}},
            "ds_config zero_optimization.offload_optimizer.device='nvme': needs "
            "zero_optimization.offload_optimizer.nvme_path, a folder on a local disk",
        ),
        (
            {"zero_optimization": {"offload_optimizer": {"device": "gpu"}}},
            "ds_config zero_optimization.offload_optimizer.device='gpu': valid choices: cpu, nvme, "
            "none",
        ),
        (
            {"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}},
            "ds_config zero_optimization.offload_optimizer.device='cpu': offload needs ZeRO stage 2 or 3",
        ),
        (
            {
                "zero_optimization": {
                    "stage": 0,
                    "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"},
                }
            },
            "ds_config zero_optimization.offload_optimizer.device='nvme': offload needs ZeRO stage "
            "2 or 3 here (FSDP2); zero_optimization.stage=0",
        ),
        (
            {"zero_optimization": {"stage": 1, "offload_param": {"device": "cpu"}}},
            "ds_config zero_optimization.offload_param.device='cpu': offload needs ZeRO stage 2 or 3",
        ),
        (
            {"aio": {"block_size": 1048576, "threads": 4}},
            "ds_config aio.threads=4: unknown DeepSpeed key; keys of 'aio' read here: "
            "aio.block_size, aio.queue_depth, aio.thread_count,",
        ),
        (
            {"zero_optimization": {"stage": 3, "zero_quantized_weights": True}},
            "ds_config zero_optimization.zero_quantized_weights=True: ZeRO++ quantized weights: not supported",
        ),
        (
            {"fp16": {"enabled": True}, "bf16": {"enabled": True}},
            "ds_config fp16.enabled=True: fp16 and bf16 are both enabled",
        ),
        (
            {"optimizer": {"type": "Lamb"}},
            "ds_config optimizer.type='Lamb': valid choices: Adam, AdamW",
        ),
        (
            {"optimizer": {"type": "Adam", "params": {"adam_w_mode": False}}},
            "ds_config optimizer.params.adam_w_mode=False",
        ),
        (
            {"scheduler": {"type": "OneCycle"}},
            "ds_config scheduler.type='OneCycle': valid choices: WarmupLR",
        ),
        ({"gradient_clipping": "one"}, "ds_config gradient_clipping='one': expected a number"),
        (
            {"communication_data_type": "int8"},
            "ds_config communication_data_type='int8': valid choices: fp32",
        ),
    ],
)
def test_bad_deepspeed_configs_are_errors_naming_the_key(tmp_path, ds, message):
    with pytest.raises(ValueError) as e:
        _read(tmp_path, ds)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


# A value of the wrong kind: (the JSON with @ where the value goes, the value as written, the key, what the
# message says is valid). Python's json reads NaN and Infinity, and 1e400 as inf.
WRONG_KIND = (
    [
        ('{"train_batch_size": @}', value, "train_batch_size", "expected an integer >= 1")
        for value in ("NaN", "1e400", "-1", "0", "2.5", "true", '"32"', '"abc"', "[32]")
    ]
    + [
        ('{"gradient_clipping": @}', value, "gradient_clipping", "expected a number >= 0")
        for value in ("NaN", "-Infinity", "1e400", "-1", "true", '"1.0"', '"abc"')
    ]
    + [
        (
            '{"zero_optimization": {"stage": @}}',
            value,
            "zero_optimization.stage",
            "valid choices: 0, 1, 2, 3",
        )
        for value in ("NaN", "1e400", "-1", "2.5", "true", '"abc"', '"4"')
    ]
    + [
        (
            '{"fp16": {"enabled": true, "initial_scale_power": @}}',
            value,
            "fp16.initial_scale_power",
            "expected an integer >= 0",
        )
        for value in ("NaN", "1e400", "-1", "12.5", "true", '"abc"', '"nan"')
    ]
    + [
        (
            '{"zero_optimization": {"sub_group_size": @}}',
            value,
            "zero_optimization.sub_group_size",
            "expected an integer >= 0",
        )
        for value in ("-1", "2.5", "true", '"abc"')
    ]
    + [
        (
            '{"optimizer": {"params": {"lr": @}}}',
            value,
            "optimizer.params.lr",
            "expected a number >= 0",
        )
        for value in ("NaN", "1e400", "-1", "true", '"1e-4"', '"abc"')
    ]
    + [
        (
            '{"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": @}}}',
            value,
            "scheduler.params.warmup_num_steps",
            "expected an integer >= 0",
        )
        for value in ("1e400", "-1", "2.5", '"5"')
    ]
    + [
        (
            '{"optimizer": {"params": {"betas": @}}}',
            value,
            "optimizer.params.betas",
            "expected two numbers",
        )
        for value in ("[NaN, 0.9]", "[0.9, 1e400]", "[true, 0.9]", '["0.9", 0.99]', "0.9")
    ]
    + [
        (
            '{"zero_optimization": {"offload_optimizer": {"device": "cpu", "ratio": @}}}',
            value,
            "zero_optimization.offload_optimizer.ratio",
            "expected a number in [0, 1]",
        )
        for value in ("NaN", "-0.5", "1.5", "true", '"abc"')
    ]
    + [
        (
            '{"zero_optimization": {"offload_optimizer": {"device": "cpu", "buffer_count": @}}}',
            value,
            "zero_optimization.offload_optimizer.buffer_count",
            "expected an integer >= 0",
        )
        for value in ("-1", "2.5", "true", '"abc"')
    ]
    + [
        (
            '{"zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": @}}}',
            value,
            "zero_optimization.offload_optimizer.nvme_path",
            "expected a folder's path",
        )
        for value in ('""', "3", "true", "[]")
    ]
    + [
        ('{"fp16": {"enabled": @}}', value, "fp16.enabled", "expected true or false")
        for value in ("2", '"abc"', "[]")
    ]
    + [
        ('{"scheduler": {"type": @}}', value, "scheduler.type", "valid choices: WarmupLR")
        for value in ("[1]", "3")
    ]
)


@pytest.mark.parametrize("text, value, key, valid", WRONG_KIND)
def test_values_of_the_wrong_kind_are_one_line_errors_naming_the_key(
    tmp_path, text, value, key, valid
):
    with pytest.raises(ValueError) as e:
        _read_text(tmp_path, text.replace("@", value))
    message = str(e.value)
    assert (
        message.startswith(f"ds_config {key}={json.loads(value)!r}: {valid}")
        and "\n" not in message
    ), message
    # A number written as a string where DeepSpeed does not read it as one: the message says so.
    assert ("not a string" in message) == (value in ('"32"', '"1.0"', '"1e-4"', '"5"')), message
