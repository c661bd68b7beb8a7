"""Byte-level BPE tokenizer (HF ``tokenizers``) with jspec's Llama 3 style chat template.

The special tokens are Llama 3's (``SPECIAL_TOKENS``; the tests' tiny default model,
tests/helpers/default_model.py, takes them and ``CHAT_TEMPLATE`` from here), plus
``<|mask|>``: the mask token PEagle and DFlash drafters put in the slots they draft.
Specials take ids 0..5, so they mean the same thing at any vocab size.
Pre-tokenization is Llama 3's split pattern (whitespace runs stay together, which suits
indented code), then the byte-level alphabet, so every byte string round-trips.

Saved with transformers' ``PreTrainedTokenizerFast.save_pretrained`` (tokenizer.json +
tokenizer_config.json): ``AutoTokenizer`` and jspec's engine load it as any HF model's.
``encode`` adds ``<|begin_of_text|>`` in front, as Llama 3's tokenizer does.
"""

from __future__ import annotations

import os

import numpy as np

SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

MASK_TOKEN = "<|mask|>"
ALL_SPECIAL_TOKENS = [*SPECIAL_TOKENS, MASK_TOKEN]
BOS, END_OF_TEXT, EOT = "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"
# Llama 3's pre-tokenizer pattern (tiktoken cl100k-like).
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _empty_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, 0)])
    return tok


def train_tokenizer(texts, vocab_size: int = 8192, min_frequency: int = 2):
    """A ``tokenizers.Tokenizer`` trained on the strings ``texts`` (specials at ids 0..5)."""
    from tokenizers import pre_tokenizers, trainers

    if vocab_size < 256 + len(ALL_SPECIAL_TOKENS):
        raise ValueError(f"vocab_size={vocab_size} cannot hold the 256 bytes and {len(ALL_SPECIAL_TOKENS)} specials")
    tok = _empty_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=ALL_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(texts, trainer, length=len(texts))
    for i, s in enumerate(ALL_SPECIAL_TOKENS):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
    return tok


def save_tokenizer(tok, folder: str):
    """tokenizer.json + tokenizer_config.json (chat template, bos/eos/pad/mask) in ``folder``."""
    from transformers import PreTrainedTokenizerFast

    os.makedirs(folder, exist_ok=True)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOT, pad_token=END_OF_TEXT, mask_token=MASK_TOKEN,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)


def load_tokenizer(folder: str):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))


def special_ids(tok) -> dict[str, int]:
    return {s: tok.token_to_id(s) for s in ALL_SPECIAL_TOKENS}


def encode_docs(tok, texts) -> list[np.ndarray]:
    """i32 token ids of each text, without specials (corpus.token_stream adds them)."""
    return [np.asarray(e.ids, np.int32) for e in tok.encode_batch(list(texts), add_special_tokens=False)]
