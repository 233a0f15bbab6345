"""Bring your own model: torchvision, Hugging Face and a user's module through the same path.

One ZeRO-3 run per foreign model at N = 2 (checkpointing every 2 steps; tests/batches/), reused by
every test here: parity with single-process training on the same global batch (fp32), initial
weights identical at N = 1, 2, 4, model state against the padded 16 P / N, an exact resume from
step 2 (the llama: tied weights and a rotary buffer), and export into the plain model class. Then
the own-loop example against the trainer, the data sources, and plan.py on a foreign model.

Covers: fsdp_zero/model/construct.py, fsdp_zero/model/contract.py, fsdp_zero/config/targets.py,
    fsdp_zero/sharding/build.py, fsdp_zero/sharding/wrap.py, fsdp_zero/checkpoint/weights.py,
    fsdp_zero/data/batches.py, fsdp_zero/api.py
"""

from __future__ import annotations

import ast
import importlib
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from fsdp_zero.checkpoint.weights import export_checkpoint
from fsdp_zero.config import RunDir
from fsdp_zero.config.choices import DataSource
from fsdp_zero.config.loader import load_config
from fsdp_zero.config.schema import DataConfig
from fsdp_zero.data.batches import build_source
from fsdp_zero.model.construct import construct, real_buffers
from fsdp_zero.model.tasks import logits_of
from fsdp_zero.sharding.build import materializer
from tests.batches import HAS_HF, VIT, run_config
from tests.conftest import REPO, TRAIN, check, figure, launch, run_script
from tests.reference import reference_run

needs_hf = pytest.mark.skipif(not HAS_HF, reason="needs transformers (pip install -e '.[hf]')")
PARAMS = [pytest.param("vit"), pytest.param("llama", marks=needs_hf)]
# the gradient norms relative: the ViT's are near 10, the llama's below 1 (float32 rounds at 6e-8)
LOSS_ATOL, WEIGHT_ATOL, NORM_RTOL = 5e-6, 3e-5, 2e-6


@pytest.fixture(scope="module")
def runs(batches):
    """Per model, ZeRO-3 at N = 2 straight through, checkpointing every 2 steps (tests/batches/); the
    llama run resumed from its step-2 checkpoint in a fresh process; the ViT's first step at N = 4."""
    return batches


@pytest.fixture(scope="module")
def references() -> dict:
    return {
        name: reference_run(run_config(name))
        for name in ("vit", "vit-defaults", "llama", "llama-tp2", "llama-sp2")
        if not name.startswith("llama") or HAS_HF
    }


# vit-defaults: weight decay, warm-up, cosine; llama-tp2: dp 2 x tp 2 by the model's own plan;
# llama-sp2: sp 2, attention through fsdp-zero's function registered with transformers
@pytest.mark.parametrize(
    "name",
    [
        *PARAMS,
        "vit-defaults",
        pytest.param("llama-tp2", marks=needs_hf),
        pytest.param("llama-sp2", marks=needs_hf),
    ],
)
def test_foreign_model_trains_like_single_process(runs, references, name):
    got, ref = runs[name], references[name]
    for key, value in ref["initial"].items():  # N = 2 initialises exactly as N = 1
        assert torch.equal(got["initial"][key], value), key
    loss = max(abs(got["losses"][s] - ref["losses"][s]) for s in ref["losses"])
    diffs = {k: (got["final"][k] - v).abs() for k, v in ref["final"].items()}
    for k, d in diffs.items():
        if k.endswith("self_attention.in_proj_bias"):
            # The key bias (middle third) has no gradient by construction (softmax is shift invariant):
            # AdamW turns its rounding-noise gradient into steps of +-lr, so it may differ by 2 lr a step.
            third = d.shape[0] // 3
            assert d[third : 2 * third].max() <= 2 * 4 * run_config(name).optim.lr
            d[third : 2 * third] = 0
    weight = max(d.max().item() for d in diffs.values())
    # the global norm before clipping, every step (llama-tp2: its split layers' mesh and the norm
    # gains' summed; the weights alone would show a wrong norm only on the steps it clips)
    norm = max(abs(got["grad_norms"][s] / ref["grad_norms"][s] - 1) for s in ref["losses"])
    figure(f"{name} ZeRO-3 N=2 vs single process: max loss diff", f"{loss:.1e}")
    figure(f"{name} ZeRO-3 N=2 vs single process: max weight diff", f"{weight:.1e}")
    figure(f"{name} ZeRO-3 N=2 vs single process: max grad norm diff (relative)", f"{norm:.1e}")
    assert loss < LOSS_ATOL and weight < WEIGHT_ATOL and norm < NORM_RTOL
    assert sorted(got["grad_norms"]) == sorted(ref["losses"])
    assert ref["losses"][4] < ref["losses"][1]  # it learns


@pytest.mark.parametrize("name", PARAMS)
def test_model_state_is_the_padded_16p_over_n(runs, name):
    """Between 16 P / N and the same with every tensor padded to ceil(rows / N) rows per rank (FSDP2
    pads; on these tiny models, with tensors of one row such as a class token, that is a few %)."""
    got = runs[name]
    padded = 4 * sum(got["shard_bytes"])  # params + grads + 2 AdamW states, fp32, all padded
    unpadded = 16 * got["num_params"] / 2
    for state in got["model_state_bytes"]:
        assert unpadded <= state <= padded + 4096  # + AdamW's scalar step tensors
    figure(
        f"{name} model state / (16 P / N), rank 0", f"{got['model_state_bytes'][0] / unpadded:.4f}"
    )


@needs_hf
def test_a_foreign_model_resumes_exactly(runs):
    """The llama run (tied embeddings, a rotary buffer) continued from its step-2 checkpoint."""
    straight, resumed = runs["llama"], runs["llama-resumed"]
    assert set(resumed["losses"]) == {3, 4}
    assert all(resumed["losses"][s] == straight["losses"][s] for s in (3, 4))
    for key, value in straight["final"].items():
        assert torch.equal(resumed["final"][key], value), key


@pytest.mark.parametrize("name", PARAMS)
def test_export_loads_into_the_plain_model_class(runs, name, tmp_path: Path):
    ckpt = runs.path(name) / "checkpoints" / "step-0000004"
    export_checkpoint(ckpt, tmp_path / "model.safetensors")
    cfg = run_config(name)
    module, _, attr = cfg.model.target.partition(":")
    cls = getattr(importlib.import_module(module), attr)
    plain = (
        cls(cls.config_class(**cfg.model.kwargs))
        if hasattr(cls, "config_class")
        else cls(**cfg.model.kwargs)
    )
    # strict: every key, right shapes
    plain.load_state_dict(load_file(tmp_path / "model.safetensors"))
    inputs = build_source(
        cfg.data, cfg.train.seed, getattr(getattr(plain, "config", None), "vocab_size", None)
    ).batch(range(2))[0]
    with torch.no_grad():
        torch.testing.assert_close(
            logits_of(plain.eval()(inputs)), runs[name]["logits"], atol=1e-5, rtol=0
        )


@needs_hf
def test_tied_embeddings_stay_one_tensor_and_every_row_trains(runs):
    """Vocabulary 101 at N = 2: rank 1's shard has a padded row; every real row still changes."""
    got = runs["llama"]
    embed, head = "model.embed_tokens.weight", "lm_head.weight"
    assert torch.equal(got["final"][embed], got["final"][head])
    changed = (got["final"][embed] - got["initial"][embed]).abs().sum(1)
    assert changed.shape[0] == 101 and bool((changed > 0).all())


def test_initial_weights_are_identical_at_four_ranks(runs, references):
    for key, value in references["vit"]["initial"].items():
        assert torch.equal(runs["vit-n4"]["initial"][key], value), key


def test_standard_init_follows_each_layers_distribution_and_keeps_buffers():
    cfg = load_config(
        None,
        [
            "model.target=tests.user_model:ConvLM",
            "model.task=custom",
            "model.loss=tests.user_model:next_token_loss",
            "model.kwargs.dim=256",
        ],
    )
    model = construct(cfg.model)
    assert all(p.is_meta for p in model.parameters())
    notes: list[str] = []
    materializer(torch.device("cpu"), cfg.model.init, 3, real_buffers(model), notes)(model)
    block = model.blocks[0]
    assert torch.equal(block.norm.running_var, torch.ones(256)) and torch.equal(
        block.norm.running_mean, torch.zeros(256)
    )
    # Conv1d: kaiming_uniform(a=sqrt(5)), fan_in = in_channels x kernel
    bound = 1 / (256 * 3) ** 0.5
    assert (
        block.conv.weight.abs().max() <= bound
        and block.conv.weight.std().item() == pytest.approx(bound / 3**0.5, rel=0.05)
    )
    assert model.embed.weight.std().item() == pytest.approx(1.0, rel=0.05)
    assert torch.equal(block.norm.weight.detach(), torch.ones(256))
    assert notes == ["standard layers"]


def test_user_model_with_a_custom_loss_on_a_token_file(tmp_path: Path):
    """model.target and model.loss from a module of the user's, data from a nanoGPT-style uint16 .bin, and no
    wrap classes named: its blocks are the class its ModuleList repeats."""
    tokens = np.random.default_rng(0).integers(0, 256, 20_000).astype(np.uint16)
    tokens.tofile(tmp_path / "train.bin")
    args = [
        "model.target=tests.user_model:ConvLM",
        "model.task=custom",
        "model.loss=tests.user_model:next_token_loss",
        "data.source=tokens",
        f"data.path={tmp_path / 'train.bin'}",
        "data.seq_len=32",
        "train.steps=4",
        "train.log_every=2",
        "train.global_batch_size=8",
        "train.micro_batch_size=2",
        "memory.profile_step=0",
        f"run.root={tmp_path}",
        "run.name=user",
    ]
    proc = check(launch(2, TRAIN, *args, torchrun=False))
    assert "initialised: standard layers" in proc.stderr
    rows = RunDir(tmp_path / "user").metric_rows()
    assert [r["step"] for r in rows] == [2, 4] and all(0 <= r["top1"] <= 1 for r in rows)
    assert all(np.isfinite(r["loss"]) for r in rows)
    # no parallel.wrap.classes: the blocks are the class its ModuleList repeats, and the plan says so
    plan = (tmp_path / "user" / "wrap_plan.txt").read_text()
    assert re.search(r"blocks\.0 +Block .*\n +blocks\.1 +Block ", plan), plan
    assert "note: blocks found, not declared: Block, repeated in blocks (2)" in plan, plan


def test_token_files_are_checked_against_the_model(tmp_path: Path):
    np.arange(300, dtype=np.uint16).tofile(tmp_path / "big.bin")
    cfg = DataConfig(source=DataSource.tokens, path=str(tmp_path / "big.bin"), seq_len=16)
    with pytest.raises(
        ValueError, match=r"token id 299, but the model's vocabulary has 256 entries"
    ):
        build_source(cfg, 0, 256)
    (tmp_path / "empty.bin").write_bytes(b"")
    cfg.path = str(tmp_path / "empty.bin")
    with pytest.raises(ValueError, match=r"holds 0 tokens, fewer than data.seq_len \+ 1 = 17"):
        build_source(cfg, 0, 256)
    np.save(tmp_path / "ids.npy", np.arange(100, dtype=np.int32))  # .npy carries its dtype
    cfg.path = str(tmp_path / "ids.npy")
    source = build_source(cfg, 0, 256)
    inputs, targets = source.batch(range(3))
    assert (
        inputs.shape == (3, 16)
        and torch.equal(inputs[:, 1:], targets[:, :-1])
        and bool((targets - inputs == 1).all())
    )


def test_image_folder_trains_with_loader_workers(tmp_path: Path):
    from PIL import Image

    rng = np.random.default_rng(0)
    for label in ("cat", "dog"):
        (tmp_path / "images" / label).mkdir(parents=True)
        for i in range(6):
            Image.fromarray(rng.integers(0, 255, (40, 48, 3), dtype=np.uint8)).save(
                tmp_path / "images" / label / f"{i}.png"
            )
    args = [
        *VIT,
        "data.source=images",
        f"data.path={tmp_path / 'images'}",
        "data.num_workers=1",
        "model.kwargs.num_classes=2",
        "train.steps=2",
        "train.log_every=1",
        "memory.profile_step=0",
        f"run.root={tmp_path}",
        "run.name=images",
    ]
    check(launch(2, TRAIN, *args, torchrun=False))
    rows = RunDir(tmp_path / "images").metric_rows()
    assert len(rows) == 2 and all("accuracy" in r and "samples_per_s_all_ranks" in r for r in rows)


def test_own_loop_example_matches_the_trainer(runs, tmp_path: Path):
    """scripts/own_loop.py (a hand-written loop: its own DataLoader, no grad accumulation) against
    scripts/train.py on the same model, data and settings (the vit run: 2 micro-batches per rank)."""
    proc = check(
        launch(
            2,
            REPO / "scripts" / "own_loop.py",
            "--steps",
            "4",
            "--run-dir",
            str(tmp_path / "own"),
            torchrun=False,
        )
    )
    own = {
        int(line.split()[1]): float(line.split()[3])
        for line in proc.stdout.splitlines()
        if line.startswith("step ")
    }
    ours = runs["vit"]["losses"]
    assert set(own) == set(ours)
    diff = max(abs(own[s] - ours[s]) for s in ours)
    figure("own-loop example vs scripts/train.py, ViT N=2: max loss diff", f"{diff:.1e}")
    assert diff < LOSS_ATOL
    assert (tmp_path / "own" / "checkpoints" / "step-0000004" / ".metadata").exists()
    assert list((tmp_path / "own" / "tb").glob("rank1/events.out.tfevents.*"))


def test_plan_answers_for_a_foreign_model_and_for_a_parameter_count(tmp_path: Path):
    out = tmp_path / "plan.json"
    proc = check(
        run_script(
            REPO / "scripts" / "plan.py",
            "simulate",
            *VIT,
            "--world-size",
            "3",
            "--json",
            str(out),
            "--strategy",
            "full_shard",
            "--strategy",
            "ddp",
        )
    )
    assert "torchvision.models:VisionTransformer, 24,234 parameters, 3 ranks" in proc.stdout
    assert "largest layer 8,544 params" in proc.stdout  # an EncoderBlock, from the wrap plan
    preds = {p["strategy"]: p for p in json.loads(out.read_text())}
    assert preds["full_shard"]["model_state"] < preds["ddp"]["model_state"]
    proc = check(
        run_script(
            REPO / "scripts" / "plan.py", "formulas", "--params", "7.5e9", "--world-size", "64"
        )
    )
    # The paper's P_os+g (Table 1) beside shard_grad_op: 16 x 7.5e9 / 64 bytes at rest, + 4 x 7.5e9 (fp32) in the step.
    assert "| 16.6 GB | shard_grad_op | 1.75 GiB | 29.69 GiB |" in proc.stdout
    assert "| 1.88 GB | full_shard | 1.75 GiB |" in proc.stdout


def test_one_build_path():
    """The trainer, the planner, compare.py and the benchmark build through fsdp_zero.sharding.build; only
    parallelize.py calls fully_shard in the library, only build.py materialises."""

    def calls(path: Path) -> set[str]:
        tree = ast.parse(path.read_text())
        return {
            n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", "")
            for n in ast.walk(tree)
            if isinstance(n, ast.Call)
        }

    def imports_build(path: Path) -> bool:
        return any(
            isinstance(n, ast.ImportFrom)
            and n.module
            in (
                "fsdp_zero.sharding.build",
                "fsdp_zero.sharding",
                "fsdp_zero.model.construct",
                "fsdp_zero.model",
            )
            and {a.name for a in n.names} & {"build", "shard", "construct"}
            for n in ast.walk(ast.parse(path.read_text()))
        )

    for path in [
        "fsdp_zero/training/trainer.py",
        "fsdp_zero/tools/planner.py",
        "fsdp_zero/tools/compare.py",
        "scripts/plan.py",
        "bench/step_time.py",
        "fsdp_zero/api.py",
    ]:
        assert imports_build(REPO / path), path
    library = list((REPO / "fsdp_zero").rglob("*.py")) + list((REPO / "scripts").glob("*.py"))
    assert {p.name for p in library if "fully_shard" in calls(p)} == {"parallelize.py"}
    assert {p.name for p in library if "to_empty" in calls(p)} == {"build.py"}


@needs_hf
def test_init_from_a_hugging_face_folder_and_a_prefixed_state_dict(tmp_path: Path):
    """A save_pretrained folder (tied weight stored once) and a DDP-style 'module.' state dict of a
    torchvision resnet (BatchNorm statistics included) load into freshly built models."""
    from fsdp_zero.checkpoint.weights import load_full_weights

    def built(cfg, seed):
        model = construct(cfg.model)
        materializer(torch.device("cpu"), cfg.model.init, seed, real_buffers(model), [])(model)
        return model

    cfg = run_config("llama")
    source = built(cfg, 5)
    from transformers import LlamaConfig, LlamaForCausalLM

    plain = LlamaForCausalLM(LlamaConfig(**cfg.model.kwargs))  # built the ordinary way, on the CPU
    # buffers as constructed
    assert torch.equal(source.model.rotary_emb.inv_freq, plain.model.rotary_emb.inv_freq)
    source.save_pretrained(tmp_path / "hf")
    target = built(cfg, 6)
    assert load_full_weights(target, tmp_path / "hf") == ""
    assert target.lm_head.weight is target.model.embed_tokens.weight
    for key, value in source.state_dict().items():
        assert torch.equal(target.state_dict()[key], value), key

    resnet = load_config(
        None,
        [
            "model.target=torchvision.models:resnet18",
            "model.kwargs.num_classes=10",
            "model.task=classification",
            "data.source=fake_images",
        ],
    )
    source = built(resnet, 1)
    source.layer1[0].bn1.running_mean.fill_(0.5)  # as if trained
    torch.save({f"module.{k}": v for k, v in source.state_dict().items()}, tmp_path / "resnet.pt")
    target = built(resnet, 2)
    assert load_full_weights(target, tmp_path / "resnet.pt") == "file names 'module.' -> ''"
    for key, value in source.state_dict().items():
        assert torch.equal(target.state_dict()[key], value), key


@needs_hf
def test_wrap_classes_come_from_the_model_or_the_error_lists_them():
    from fsdp_zero.config.schema import WrapConfig
    from fsdp_zero.sharding.wrap import build_wrap_plan

    llama = construct(run_config("llama").model)
    # Hugging Face's _no_split_modules: LlamaDecoderLayer
    plan = build_wrap_plan(llama, WrapConfig(), 2)
    assert [u.class_name for u in plan.units] == ["LlamaDecoderLayer"] * 2 + ["LlamaForCausalLM"]
    assert sum(u.num_params for u in plan.units) == sum(p.numel() for p in llama.parameters())
    resnet = construct(
        load_config(
            None,
            [
                "model.target=torchvision.models:resnet18",
                "model.task=classification",
                "data.source=fake_images",
            ],
        ).model
    )
    # no declared class: the class repeated in its Sequentials (layer1-4), said in the plan's note
    plan = build_wrap_plan(resnet, WrapConfig(), 2)
    assert [u.class_name for u in plan.units] == ["BasicBlock"] * 8 + ["ResNet"]
    assert plan.notes == [
        "blocks found, not declared: BasicBlock, repeated in layer1 (2), layer2 (2), layer3 (2), layer4 (2); "
        "to wrap other classes, set parallel.wrap.classes (e.g. parallel.wrap.classes=[BasicBlock])"
    ]
    alexnet = construct(
        load_config(
            None,
            [
                "model.target=torchvision.models:alexnet",
                "model.task=classification",
                "data.source=fake_images",
            ],
        ).model
    )
    with pytest.raises(
        ValueError,
        match=r"AlexNet declares no block class .* repeats none in a ModuleList or Sequential; set "
        r"parallel\.wrap\.classes .*module classes: AdaptiveAvgPool2d, Conv2d, Dropout",
    ):
        build_wrap_plan(alexnet, WrapConfig(), 2)
    plan = build_wrap_plan(alexnet, WrapConfig(classes=["Sequential"]), 2)
    assert [u.fqn for u in plan.units] == ["features", "classifier", ""] and not plan.notes


@needs_hf
def test_data_that_the_model_cannot_take_is_refused_before_training():
    from fsdp_zero.data.batches import fake_images
    from fsdp_zero.training.trainer import _check_data_fits

    cfg = run_config("vit")
    cfg.data.num_classes = 12  # the model has 10 outputs
    with pytest.raises(
        ValueError,
        match=r"has 12 classes but the model's last layer has 10 outputs; .*num_classes=12",
    ):
        _check_data_fits(cfg.data, cfg.model.task, construct(cfg.model), fake_images(cfg.data, 0))
    llama = run_config("llama")
    llama.data.seq_len = 65  # max_position_embeddings 64
    with pytest.raises(ValueError, match=r"data\.seq_len=65 > the model's longest sequence 64"):
        _check_data_fits(llama.data, llama.model.task, construct(llama.model), None)


@needs_hf
def test_a_hugging_face_model_can_bring_its_own_initialiser():
    from fsdp_zero.config.choices import Init
    from fsdp_zero.sharding.build import initialize

    cfg = run_config("llama")
    model = construct(cfg.model)
    # memory only
    materializer(torch.device("cpu"), cfg.model.init, None, real_buffers(model), [])(model)
    note = initialize(model, Init.model, seed=3)
    assert note == "LlamaForCausalLM._init_weights (torch.manual_seed(3))"
    weight = model.model.layers[0].mlp.up_proj.weight
    assert weight.std().item() == pytest.approx(
        cfg.model.kwargs["initializer_range"] if "initializer_range" in cfg.model.kwargs else 0.02,
        rel=0.1,
    )
    assert torch.equal(model.model.norm.weight.detach(), torch.ones(32))
