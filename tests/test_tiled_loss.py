"""The tiled loss (``train.loss_chunk``): the head and the fp32 cross-entropy over chunks of tokens give
the untiled loss and gradients (plain and masked, tied and untied, the built-in model and a Hugging Face
Llama, under FSDP2 with the head a unit of its own and under DDP), hold one chunk's logits at a time, and
train at 2 ranks as the untiled loss does; the models it cannot tile are refused in one line. In this
process (one rank of gloo for FSDP2 and DDP), and one run of the batched 2-rank launch.

Covers: fsdp_zero/model/tasks.py (the tiled loss, `_lm_sums` chunked), fsdp_zero/model/contract.py (the
head), fsdp_zero/tools/formulas.py (`loss_logits_bytes`)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from fsdp_zero.config.presets import PRESETS
from fsdp_zero.config.schema import ModelConfig
from fsdp_zero.data.token_files import IGNORE_INDEX
from fsdp_zero.model.lora import LoRALinear
from fsdp_zero.model.tasks import _lm_sums, build_task
from fsdp_zero.model.transformer import Transformer
from fsdp_zero.tools.formulas import loss_logits_bytes
from tests.batches import HAS_HF
from tests.conftest import figure
from tests.test_parity import LOSS_ATOL, NORM_ATOL, WEIGHT_ATOL

VOCAB = 3000  # large beside gpt_nano's dim 64: the logits are the largest tensors
BATCH, SEQ = 2, 16
TOKENS = BATCH * SEQ
CHUNKS = [1, 7, TOKENS, 100]  # one token; 7, which does not divide 32; all; more than all


def _nano(tied: bool) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(replace(PRESETS["gpt_nano"], vocab_size=VOCAB, tie_embeddings=tied))
    model.init_weights(0)
    return model


def _llama(tied: bool) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.hf_fixtures import LLAMA_CONFIG

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**{**LLAMA_CONFIG, "tie_word_embeddings": tied}))


def _batch(vocab: int, masked: bool) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    inputs = torch.randint(0, vocab, (BATCH, SEQ), generator=gen)
    targets = torch.randint(0, vocab, (BATCH, SEQ), generator=gen)
    if masked:  # a prompt left out in each row, across the chunks' edges
        targets[0, :5], targets[1, 3:12] = IGNORE_INDEX, IGNORE_INDEX
    return inputs, targets


def _loss_and_grads(
    model: nn.Module, batch: tuple, masked: bool, chunk: int
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One forward and backward of the loss ``train.loss_chunk=chunk`` builds: the loss, and each
    parameter's gradient (whole)."""
    model.zero_grad(set_to_none=True)
    loss, _ = build_task(ModelConfig(), masked=masked, loss_chunk=chunk)(model, batch)
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad
        grads[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).clone()
    return loss.detach(), grads


def _assert_same(model: nn.Module, vocab: int, masked: bool, chunk: int) -> None:
    """Tiled against untiled: the loss to 1e-6 relative, every gradient to 1e-5 relative (an
    element's own, or of its tensor's largest where the element is near 0: fp32 rounding leaves
    up to 1.2e-6 of it at chunks of 1 token)."""
    batch = _batch(vocab, masked)
    ref, ref_grads = _loss_and_grads(model, batch, masked, 0)
    loss, grads = _loss_and_grads(model, batch, masked, chunk)
    assert abs(loss - ref) <= 1e-6 * abs(ref), (loss, ref)
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        atol = 1e-5 * ref_grads[name].abs().max().item()
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-5, atol=atol, msg=name)


@pytest.mark.parametrize("masked", [False, True], ids=["plain", "masked"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("chunk", CHUNKS)
def test_the_tiled_loss_and_gradients_are_the_untiled_ones(chunk: int, tied: bool, masked: bool):
    _assert_same(_nano(tied), VOCAB, masked, chunk)


@pytest.mark.skipif(not HAS_HF, reason="needs transformers (the hf extra)")
@pytest.mark.parametrize("masked", [False, True], ids=["plain", "masked"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("chunk", [1, 7, 100])
def test_a_hugging_face_llamas_head_is_tiled_the_same(chunk: int, tied: bool, masked: bool):
    """LlamaForCausalLM's lm_head (its get_output_embeddings()), tied to embed_tokens or not."""
    from tests.hf_fixtures import VOCAB_SIZE

    _assert_same(_llama(tied), VOCAB_SIZE, masked, chunk)


class _Widest(TorchDispatchMode):
    """The most rows of any vocabulary-wide tensor an op makes (not a view of its inputs) while open."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab, self.rows = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        given = {
            t.untyped_storage().data_ptr()
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor)
        }
        for t in tree_flatten(out)[0]:
            fresh = isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in given
            if fresh and t.dim() and t.shape[-1] == self.vocab:
                self.rows = max(self.rows, t.numel() // self.vocab)
        return out


def _logits_held(chunk: int) -> tuple[int, int]:
    """(bytes of vocabulary-wide tensors the loss's forward keeps for backward, rows of the widest
    one made in forward and backward) for gpt_nano at ``train.loss_chunk=chunk``."""
    model, saved = _nano(tied=False), []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.dim() and t.shape[-1] == VOCAB:
            saved.append(t.numel() * t.element_size())
        return t

    loss_fn = build_task(ModelConfig(), loss_chunk=chunk)
    with _Widest(VOCAB) as widest:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss, _ = loss_fn(model, _batch(VOCAB, masked=False))
        loss.backward()
    return sum(saved), widest.rows


@pytest.mark.parametrize("chunk", [1, 7])
def test_the_logits_of_one_chunk_only_are_alive(chunk: int):
    """Untiled, the forward keeps the fp32 logits of every token for backward and makes a
    (tokens x vocab) tensor; tiled, it keeps none (each chunk's are recomputed in backward) and no
    tensor of either pass has more than one chunk's rows."""
    saved, rows = _logits_held(0)
    assert saved >= TOKENS * VOCAB * 4 and rows == TOKENS
    saved, rows = _logits_held(chunk)
    figure(f"tiled loss, chunk {chunk} of {TOKENS} tokens", f"logits kept {saved} B, rows {rows}")
    assert saved == 0 and rows == chunk


@pytest.mark.parametrize("chunk", [7, 100])
def test_a_chunked_evaluation_sums_what_the_untiled_one_does(chunk: int):
    """`_lm_sums` (the evaluation's) with ``chunk``: the same float64 loss sum and token count,
    without gradients."""
    model, batch = _nano(tied=True), _batch(VOCAB, masked=True)
    with torch.no_grad():
        ref, got = _lm_sums(model, batch), _lm_sums(model, batch, chunk=chunk)
    assert got.dtype == torch.float64 and got[1] == ref[1] == TOKENS - 14
    assert abs(got[0] - ref[0]) <= 1e-9 * abs(ref[0]), (got, ref)


def _head_unit(model: Transformer) -> nn.Module:
    """FSDP2 with the head a unit of its own that reshards after forward, then the blocks and root."""
    fully_shard(model.output)  # reshard_after_forward=True: its weight freed after its forward
    for block in model.layers.values():
        fully_shard(block)
    return fully_shard(model)


@pytest.mark.parametrize(
    "wrap", [_head_unit, DistributedDataParallel], ids=["fsdp2-head-unit", "ddp"]
)
@pytest.mark.parametrize("masked", [False, True], ids=["plain", "masked"])
def test_a_sharded_or_replicated_head_is_tiled_the_same(
    one_rank, wrap: Callable[[nn.Module], nn.Module], masked: bool
):
    """The head computes the loss inside its own forward, where FSDP2 has gathered its weight, and
    recomputes it in its backward, after FSDP2 gathered it again: a head unit that reshards after
    forward gives the untiled loss and gradients; so does DDP's wrapper."""
    model = wrap(_nano(tied=False))
    _assert_same(model, VOCAB, masked, 7)
    if wrap is _head_unit:  # resharded after the forward: the weight is its shard again
        model(_batch(VOCAB, masked)[0])
        assert type(model.output.weight).__name__ == "DTensor"


class _SoftCapped(Transformer):
    """Gemma 2's final logit soft-cap: the logits changed after the head."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return 30.0 * torch.tanh(super().forward(tokens) / 30.0)


def _lora_head() -> nn.Module:
    model = _nano(tied=False)
    model.output = LoRALinear(model.output, rank=4, alpha=8.0, dropout=0.0)
    return model


def _soft_capped() -> nn.Module:
    return _SoftCapped(replace(PRESETS["gpt_nano"], vocab_size=VOCAB))


def _no_head() -> nn.Module:
    return nn.Sequential(nn.Embedding(VOCAB, 8), nn.Linear(8, VOCAB))


@pytest.mark.parametrize(
    "make, message",
    [
        (_lora_head, "the output head is a LoRALinear, not a plain nn.Linear"),
        (_soft_capped, "_SoftCapped does not return its head's output as it is"),
        (_no_head, "Sequential declares no output head (get_output_embeddings())"),
    ],
    ids=["lora-head", "soft-cap", "no-head"],
)
def test_a_head_it_cannot_tile_is_refused_in_one_line(make: Callable[[], nn.Module], message: str):
    with pytest.raises(ValueError) as e:
        build_task(ModelConfig(), loss_chunk=7)(make(), _batch(VOCAB, masked=False))
    assert str(e.value).startswith(f"train.loss_chunk=7: {message}")
    assert str(e.value).endswith("set train.loss_chunk=0") and "\n" not in str(e.value)


def test_the_logits_formula_counts_one_chunks_rows():
    """fp32 logits, compute-dtype logits and their fp32 gradient, per row of the micro-batch's
    tokens, or of one chunk's."""
    tokens, vocab = 8 * 4096, 128_256  # Llama 3's vocabulary
    assert loss_logits_bytes(tokens, vocab, 2) == 42_026_926_080  # 39 GiB
    assert loss_logits_bytes(tokens, vocab, 4) == 50_432_311_296
    assert loss_logits_bytes(tokens, vocab, 2, chunk=1024) == 1_313_341_440  # 1.2 GiB
    assert loss_logits_bytes(100, vocab, 2, chunk=1024) == loss_logits_bytes(100, vocab, 2)


def test_two_ranks_train_the_same_with_the_tiled_loss(batches):
    """``masked-tiled`` (FSDP2 at 2 ranks, gpt_nano, masked data, chunks of 7 of 64 tokens) against
    ``masked`` (the same run untiled): losses, gradient norms, final weights and the validation loss
    (evaluated chunk by chunk) at the parity suite's fp32 tolerances."""
    got, ref = batches["masked-tiled"], batches["masked"]
    assert all(torch.equal(got["initial"][k], ref["initial"][k]) for k in ref["initial"])
    losses = max(abs(got["losses"][s] - ref["losses"][s]) for s in ref["losses"])
    norms = max(abs(got["grad_norms"][s] - ref["grad_norms"][s]) for s in ref["grad_norms"])
    weights = max((got["final"][k] - ref["final"][k]).abs().max().item() for k in ref["final"])
    evals = abs(got["evals"][8]["eval/loss"] - ref["evals"][8]["eval/loss"])
    figure(
        "masked training, tiled loss (chunk 7) against untiled, N = 2",
        f"losses {losses:.2e}, grad norms {norms:.2e}, weights {weights:.2e}, eval/loss {evals:.2e}",
    )
    assert losses < LOSS_ATOL and norms < NORM_ATOL and weights < WEIGHT_ATOL and evals < 1e-6
    # the chunks' sums round differently: the tiled loss ran, not ``masked`` twice
    assert weights > 0
