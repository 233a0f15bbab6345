"""A tiny Hugging Face model folder, made in the test (no network): what ``model.pretrained`` reads.

`tiny_llama` saves a 2-layer Llama (vocabulary 101, tied embeddings, ~30 K parameters) with
``save_pretrained`` (config.json, generation_config.json, model.safetensors), a byte-level BPE
tokenizer trained on a few lines with `tokenizers` (tokenizer.json, tokenizer_config.json, ...),
and a binary tokenizer.model stand-in, so the copy into the run directory is shown byte for byte.
"""

from __future__ import annotations

from pathlib import Path

import torch

LLAMA_CONFIG = dict(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True)
BINARY = bytes(range(256)) * 4  # tokenizer.model stand-in: every byte value


def tiny_llama(folder: Path, seed: int = 0) -> Path:
    """Writes the folder (see the module docstring) and returns it."""
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(seed)
    LlamaForCausalLM(LlamaConfig(**LLAMA_CONFIG)).save_pretrained(folder)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=_bpe(), eos_token="</s>", bos_token="<s>")
    tokenizer.save_pretrained(folder)
    (folder / "tokenizer.model").write_bytes(BINARY)
    return folder


def _bpe():  # noqa: ANN202
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20, trainer)
    return tok
