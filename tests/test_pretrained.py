"""A Hugging Face folder in (model.pretrained), a from_pretrained folder out (scripts/export.py).

One ZeRO-3 run at N = 2 from a tiny Llama folder saved in the test (tests/hf_fixtures.py; the run in
tests/batches' 2-rank launch, its resume from step 2 in the 2-resume launch): it starts from the
folder's weights and trains as a single process does from `from_pretrained`'s model; its export loads
with `AutoModelForCausalLM.from_pretrained` with no missing or unexpected keys and the trained
model's logits. The bad folders and settings end before training, in this process.

Covers: fsdp_zero/model/hf.py, fsdp_zero/model/source.py, fsdp_zero/checkpoint/export.py
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fsdp_zero.config.loader import load_config
from fsdp_zero.data.batches import build_source
from fsdp_zero.model.construct import construct
from tests.batches import BY_NAME, HAS_HF
from tests.conftest import REPO, TRAIN, check, figure, run_script
from tests.hf_fixtures import LLAMA_CONFIG
from tests.reference import reference_run

pytestmark = pytest.mark.skipif(not HAS_HF, reason="needs transformers (pip install -e '.[hf]')")
EXPORT = REPO / "scripts" / "export.py"
COPIED = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
)


def _cfg(name: str, root: Path):
    return load_config(None, [a.format(root=root) for a in BY_NAME[name].args])


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.hf_fixtures import tiny_llama

    return tiny_llama(tmp_path_factory.mktemp("hf") / "tiny-llama")


def _train(tmp_path: Path, *args: str):  # noqa: ANN202
    return run_script(
        TRAIN,
        "data.seq_len=16",
        "train.steps=1",
        "train.global_batch_size=2",
        "train.micro_batch_size=2",
        f"run.root={tmp_path}",
        "run.name=r",
        "metrics.tensorboard=false",
        *args,
    )


def _one_line_exit_2(proc, tmp_path: Path, *fragments: str) -> str:  # noqa: ANN001
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("error: ") and all(f in line for f in fragments), line
    assert not (tmp_path / "r").exists()  # nothing written
    return line


# ---------------------------------------------------------------------------------
# At 2 ranks


def test_a_pretrained_run_starts_from_the_folder_and_trains_as_from_pretrained(batches):
    from transformers import AutoModelForCausalLM

    got, root = batches["pretrained"], batches.root
    saved = load_file(root / "tiny-llama" / "model.safetensors")
    for name, value in saved.items():  # the shards hold the folder's weights before step 1
        assert torch.equal(got["initial"][name], value), name
    # tied, saved once
    assert torch.equal(got["initial"]["lm_head.weight"], saved["model.embed_tokens.weight"])
    hf = AutoModelForCausalLM.from_pretrained(root / "tiny-llama")
    ref = reference_run(_cfg("pretrained", root), initial=hf.state_dict())
    diff = max(abs(got["losses"][s] - ref["losses"][s]) for s in ref["losses"])
    figure("pretrained ZeRO-3 N=2 vs single-process from_pretrained: max loss diff", f"{diff:.1e}")
    assert diff < 5e-6
    copied = batches.path("pretrained") / "hf"
    assert sorted(p.name for p in copied.iterdir()) == sorted(COPIED)
    for name in COPIED:  # byte for byte, the binary tokenizer.model included
        assert (copied / name).read_bytes() == (root / "tiny-llama" / name).read_bytes(), name


def test_a_pretrained_run_resumes_from_its_checkpoint_not_the_folder(batches):
    straight, resumed = batches["pretrained"], batches["pretrained-resumed"]
    assert set(resumed["losses"]) == {3, 4} and all(
        resumed["losses"][s] == straight["losses"][s] for s in (3, 4)
    )
    for key, value in straight["final"].items():
        assert torch.equal(resumed["final"][key], value), key


def _from_pretrained(out: Path):  # noqa: ANN202
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(
        info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")
    ), info
    return model


def _logits_diff(model, cfg, logits) -> float:  # noqa: ANN001
    inputs = build_source(cfg.data, cfg.train.seed, LLAMA_CONFIG["vocab_size"]).batch(range(2))[0]
    with torch.no_grad():
        return (model.eval()(inputs).logits - logits).abs().max().item()


def test_the_export_is_a_from_pretrained_folder_with_the_trained_models_outputs(
    batches, tmp_path: Path
):
    from transformers import AutoTokenizer

    got, root = batches["pretrained"], batches.root
    ckpt = batches.path("pretrained") / "checkpoints" / "step-0000004"
    out = tmp_path / "out"
    proc = check(run_script(EXPORT, str(ckpt), "--out", str(out)))
    assert "note:" not in proc.stderr
    diff = _logits_diff(_from_pretrained(out), _cfg("pretrained", root), got["logits"])
    figure(
        "pretrained export: from_pretrained logits vs the trained model (fp32), max abs diff",
        f"{diff:.1e}",
    )
    assert diff <= 1e-5
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["dtype"] == "float32"
    assert config["tie_word_embeddings"] is True
    for name in COPIED[1:]:
        assert (out / name).read_bytes() == (root / "tiny-llama" / name).read_bytes(), name
    assert AutoTokenizer.from_pretrained(out)("the fox")["input_ids"]

    # bf16 in shards: Hugging Face's index and names, the dtype in config.json.
    check(
        run_script(
            EXPORT,
            str(ckpt),
            "--out",
            str(tmp_path / "bf16"),
            "--dtype",
            "bf16",
            "--max-shard-size",
            "20KB",
        )
    )
    index = json.loads((tmp_path / "bf16" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    half = _from_pretrained(tmp_path / "bf16")
    assert half.dtype == torch.bfloat16
    # The values too: the trained model's logits within bf16's rounding of the weights (8 bits of mantissa,
    # a relative 2^-9 a weight; measured about 1e-2 on these logits).
    half_diff = _logits_diff(half.float(), _cfg("pretrained", root), got["logits"])
    figure(
        "pretrained export in bf16: from_pretrained logits vs the trained model (fp32), max abs diff",
        f"{half_diff:.1e}",
    )
    assert 0 < half_diff < 5e-2


def test_a_pretrained_runs_export_applies_its_model_kwargs_over_the_folders_config(
    batches, tmp_path: Path
):
    """A model.pretrained run trained with model.kwargs (here rms_norm_eps=0.1) over the folder's config.json:
    its export's config.json holds the value the run trained with, not the folder's 1e-6."""
    from omegaconf import OmegaConf

    ckpt = tmp_path / "run" / "checkpoints" / "step-0000004"
    shutil.copytree(batches.path("pretrained") / "checkpoints" / "step-0000004", ckpt)
    cfg = OmegaConf.load(ckpt / "config.yaml")
    cfg.model.kwargs = {"rms_norm_eps": 0.1}
    OmegaConf.save(cfg, ckpt / "config.yaml")
    check(run_script(EXPORT, str(ckpt), "--out", str(tmp_path / "out")))
    assert (
        json.loads((batches.root / "tiny-llama" / "config.json").read_text())["rms_norm_eps"]
        == 1e-6
    )
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["rms_norm_eps"] == 0.1 and config["architectures"] == ["LlamaForCausalLM"]


def _as_model(ckpt: Path, dest: Path, **model: object) -> Path:
    """The checkpoint copied, with config.yaml saying the model was ``model`` (the weights are the same)."""
    from omegaconf import OmegaConf

    shutil.copytree(ckpt, dest)
    cfg = OmegaConf.load(dest / "config.yaml")
    cfg.model.pretrained = None
    for key, value in model.items():
        cfg.model[key] = value
    OmegaConf.save(cfg, dest / "config.yaml")
    return dest


def test_a_transformers_target_exports_a_config_built_from_its_kwargs(batches, tmp_path: Path):

    ckpt = _as_model(
        batches.path("pretrained") / "checkpoints" / "step-0000004",
        tmp_path / "run" / "ckpt",
        target="transformers:LlamaForCausalLM",
        kwargs=LLAMA_CONFIG,
    )
    check(run_script(EXPORT, str(ckpt), "--out", str(tmp_path / "out")))
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "config.json",
        "model.safetensors",
    ]
    assert (
        _logits_diff(
            _from_pretrained(tmp_path / "out"),
            _cfg("pretrained", batches.root),
            batches["pretrained"]["logits"],
        )
        <= 1e-5
    )


def test_weights_only_and_a_model_that_is_not_hugging_faces_export_the_weights_alone(
    batches, tmp_path: Path
):
    ckpt = batches.path("pretrained") / "checkpoints" / "step-0000004"
    proc = check(run_script(EXPORT, str(ckpt), "--out", str(tmp_path / "w"), "--weights-only"))
    assert (
        sorted(p.name for p in (tmp_path / "w").iterdir()) == ["model.safetensors"]
        and not proc.stderr
    )
    builtin = _as_model(ckpt, tmp_path / "b" / "ckpt")
    vit = _as_model(ckpt, tmp_path / "v" / "ckpt", target="torchvision.models:VisionTransformer")
    for source, why in (
        (builtin, "the built-in model (model.preset=gpt_tiny) is not a Hugging Face model"),
        (
            vit,
            "model.target=torchvision.models:VisionTransformer is not a Hugging Face model class "
            "(it has no config_class)",
        ),
    ):
        out = source.parent / "out"
        proc = check(run_script(EXPORT, str(source), "--out", str(out)))
        assert proc.stderr.strip().splitlines() == [
            f"note: no config.json: {why}; the weights only"
        ]
        assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    proc = check(run_script(EXPORT, str(ckpt), "--out", str(tmp_path / "one.safetensors")))
    assert "is one file; give a folder for a from_pretrained folder" in proc.stderr


# ---------------------------------------------------------------------------------
# Bad folders and settings: one line, exit 2, nothing written


def test_a_folder_without_config_json_is_refused(tmp_path: Path):
    (tmp_path / "empty").mkdir()
    _one_line_exit_2(
        _train(tmp_path, f"model.pretrained={tmp_path / 'empty'}"), tmp_path, "no config.json in it"
    )


def test_an_architecture_transformers_does_not_know_is_refused(folder: Path, tmp_path: Path):
    bad = shutil.copytree(folder, tmp_path / "bad")
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForCausalLMM"]}))
    _one_line_exit_2(
        _train(tmp_path, f"model.pretrained={bad}"),
        tmp_path,
        "'LlamaForCausalLMM'",
        "does not have; e.g. LlamaForCausalLM",
        "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    )


def test_remote_code_is_refused_and_never_run_without_trust_remote_code(
    folder: Path, tmp_path: Path
):
    bad = shutil.copytree(folder, tmp_path / "remote")
    marker = tmp_path / "ran"
    (bad / "modeling_evil.py").write_text(
        f"open({str(marker)!r}, 'w').write('imported')\nfrom transformers import LlamaForCausalLM as EvilForCausalLM\n"
    )
    config = json.loads((bad / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
    (bad / "config.json").write_text(json.dumps(config))
    _one_line_exit_2(
        _train(tmp_path, f"model.pretrained={bad}"),
        tmp_path,
        "auto_map asks to run the folder's own code (modeling_evil.EvilForCausalLM)",
        "model.trust_remote_code=true",
    )
    assert not marker.exists()


def test_weights_that_do_not_fit_the_config_name_the_key(folder: Path, tmp_path: Path):
    bad = shutil.copytree(folder, tmp_path / "misshaped")
    weights = load_file(bad / "model.safetensors")
    weights["model.norm.weight"] = torch.ones(31)
    save_file(weights, bad / "model.safetensors", metadata={"format": "pt"})
    _one_line_exit_2(
        _train(tmp_path, f"model.pretrained={bad}"),
        tmp_path,
        f"model.pretrained={str(bad)!r} does not fit",
        "mis-shaped: model.norm.weight: file (31,) vs model (32,)",
    )


@pytest.mark.parametrize(
    "extra, fragment",
    [
        ("model.init_from={folder}/model.safetensors", "and model.init_from="),
        ("model.target=transformers:LlamaForCausalLM", "and model.target="),
        (
            "model.n_layers=2",
            "model.n_layers=2 only applies to the built-in model, not to model.pretrained=",
        ),
    ],
)
def test_pretrained_with_a_setting_it_replaces_is_refused(
    folder: Path, tmp_path: Path, extra: str, fragment: str
):
    proc = _train(tmp_path, f"model.pretrained={folder}", extra.format(folder=folder))
    _one_line_exit_2(proc, tmp_path, fragment)


def test_trust_remote_code_without_pretrained_is_refused(tmp_path: Path):
    _one_line_exit_2(
        _train(tmp_path, "model.trust_remote_code=true"),
        tmp_path,
        "applies only to model.pretrained",
    )


def test_pretrained_without_transformers_names_the_extra(folder: Path, monkeypatch):
    cfg = load_config(None, [f"model.pretrained={folder}"])
    # import transformers fails as when not installed
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(
        ValueError,
        match=r'needs transformers, which is not installed \(pip install -e "\.\[hf\]"\)',
    ):
        construct(cfg.model)


def test_kwargs_override_the_folders_config(folder: Path):
    model = construct(
        load_config(None, [f"model.pretrained={folder}", "model.kwargs.num_hidden_layers=1"]).model
    )
    assert len(model.model.layers) == 1 and model.config.hidden_size == 32
    assert all(p.is_meta for p in model.parameters())  # built like every model: shapes only


def test_a_pytorch_model_bin_loads_with_weights_only(folder: Path, tmp_path: Path):
    """A folder with pytorch_model.bin instead of safetensors: read by torch.load(weights_only=True)."""
    old = shutil.copytree(folder, tmp_path / "bin")
    torch.save(load_file(old / "model.safetensors"), old / "pytorch_model.bin")
    (old / "model.safetensors").unlink()
    proc = check(_train(tmp_path, f"model.pretrained={old}", "checkpoint.enabled=false"))
    assert f"initialised from {old / 'pytorch_model.bin'}" in proc.stderr
