"""Hugging Face artefacts made inside the tests, in seconds, with no network: a tiny tokenizer, and
a tiny Llama folder that uses it.

`tiny_tokenizer_dir` (session-scoped; tests/conftest.py makes it visible to every test module) is a
byte-level BPE tokenizer trained here with `tokenizers` (a vocabulary of 400, special tokens
``<s>`` (BOS, prepended by ``tokenizer(text)``), ``</s>`` (EOS) and ``<pad>``), wrapped as
transformers' ``PreTrainedTokenizerFast`` and saved with ``save_pretrained``, so that
``AutoTokenizer.from_pretrained(dir)`` loads it.

`tiny_llama` saves a 2-layer Llama (the tokenizer's vocabulary, tied embeddings) with
``save_pretrained`` (config.json, generation_config.json, model.safetensors), that tokenizer, and a
binary tokenizer.model stand-in, so the copy into the run directory is shown byte for byte: what
``model.pretrained`` reads. Nothing here imports transformers at module level.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

SPECIALS = ("<s>", "</s>", "<pad>")
VOCAB_SIZE = 400
LLAMA_CONFIG = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    tie_word_embeddings=True,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=2,
)  # the tokenizer's <s>, </s>, <pad>
BINARY = bytes(range(256)) * 4  # tokenizer.model stand-in: every byte value
_WORDS = (
    "the model shards its parameters over every rank and gathers them for each unit before the forward "
    "pass; gradients are reduced and scattered so that no rank holds the whole state. Zürich naïve café "
    "résumé 東京 🙂"
).split()


def sample_text(rng: random.Random, words: int) -> str:
    """``words`` words of the tokenizer's training vocabulary, with newlines and non-ASCII text in between."""
    out = []
    for _ in range(words):
        out.append(rng.choice(_WORDS))
        out.append("\n" if rng.random() < 0.08 else " ")
    return "".join(out).strip()


def make_tiny_tokenizer(folder: Path) -> Path:
    """Trains the tiny byte-level BPE tokenizer and saves it as a transformers tokenizer folder.

    Returns:
        ``folder``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIALS),
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    rng = random.Random(0)
    tok.train_from_iterator([sample_text(rng, 50) for _ in range(200)], trainer=trainer)
    # tokenizer(text) starts each text with BOS, as Llama's tokenizers do; EOS is prepare_data's to add.
    bos = ("<s>", tok.token_to_id("<s>"))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[bos])
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    wrapped.save_pretrained(folder)
    return folder


def tiny_llama(folder: Path, seed: int = 0) -> Path:
    """Writes the Llama folder (see the module docstring) and returns it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    LlamaForCausalLM(LlamaConfig(**LLAMA_CONFIG)).save_pretrained(folder)
    make_tiny_tokenizer(folder)
    (folder / "tokenizer.model").write_bytes(BINARY)
    return folder


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tokenizer folder (``AutoTokenizer.from_pretrained`` loads it); skips the test without transformers."""
    pytest.importorskip("transformers")
    return make_tiny_tokenizer(tmp_path_factory.mktemp("tiny-tokenizer"))
