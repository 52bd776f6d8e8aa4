"""Small tokenizers of every kind a model may bring, trained offline with ``tokenizers``: GPT-2 style
byte-level BPE, Metaspace BPE, Unigram with Metaspace (T5/XLNet style), byte-fallback BPE (Llama
and Mistral style) and WordPiece (BERT style); each wrapped for transformers with special tokens."""

# ruff: noqa: RUF001

from __future__ import annotations

import json
from collections.abc import Callable

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

CORPUS = [
    "The quick brown fox jumps over the lazy dog. Hello world! How are you today?",
    "The capital of France is Paris. The capital of Japan is Tokyo.",
    "Café crème brûlée, naïve façade, señor, Zürich, Ærøskøbing, déjà vu, Ångström.",
    "中文测试，你好世界。日本語のテキスト、こんにちは。한국어 텍스트입니다.",
    "Emoji: 😀 🎉 👍🏽 👨‍👩‍👧 🇫🇷 ❤️ and more 🚀✨ in a sentence.",
    "  leading spaces and\ttabs\nnew lines\n\n  indented code: def f(x): return x + 1",
]

BYTE_TOKENS = [f"<0x{b:02X}>" for b in range(256)]


def byte_level_bpe() -> PreTrainedTokenizerFast:
    """GPT-2 style byte-level BPE with two special tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        special_tokens=["<|endoftext|>", "<|im_start|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS * 5, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|endoftext|>",
        bos_token="<|im_start|>",
        clean_up_tokenization_spaces=False,
    )


def _with_byte_fallback(tokenizer: Tokenizer) -> Tokenizer:
    """Add the 256 ``<0xXX>`` tokens to the model vocabulary and turn byte fallback on."""
    spec = json.loads(tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    for token in BYTE_TOKENS:
        vocab.setdefault(token, len(vocab))
    spec["model"]["byte_fallback"] = True
    spec["model"]["unk_token"] = "<unk>"
    return Tokenizer.from_str(json.dumps(spec))


def _wrap(tokenizer: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        clean_up_tokenization_spaces=False,
    )


def _bpe(setup: Callable[[Tokenizer], None], byte_fallback: bool) -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    setup(tokenizer)
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<unk>", "<s>", "</s>"],
        limit_alphabet=50 if byte_fallback else 1000,
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS * 5, trainer=trainer)
    return _wrap(_with_byte_fallback(tokenizer) if byte_fallback else tokenizer)


def byte_fallback_bpe() -> PreTrainedTokenizerFast:
    """Llama-2 / Mistral style: "▁" for spaces, byte fallback, one leading space stripped on decode."""

    def setup(tokenizer: Tokenizer) -> None:
        tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement="▁", prepend_scheme="never", split=True
        )
        tokenizer.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
        )

    return _bpe(setup, byte_fallback=True)


def metaspace_bpe() -> PreTrainedTokenizerFast:
    """Metaspace pre-tokenizer and decoder ("▁" prepended to the first word), no byte fallback."""

    def setup(tokenizer: Tokenizer) -> None:
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")

    return _bpe(setup, byte_fallback=False)


def metaspace_byte_fallback_bpe() -> PreTrainedTokenizerFast:
    """Metaspace with byte fallback (newer Llama/Mistral conversions)."""

    def setup(tokenizer: Tokenizer) -> None:
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        tokenizer.decoder = decoders.Sequence(
            [decoders.ByteFallback(), decoders.Metaspace(replacement="▁", prepend_scheme="first")]
        )

    return _bpe(setup, byte_fallback=True)


def unigram_metaspace() -> PreTrainedTokenizerFast:
    """T5 / XLNet style Unigram with the Metaspace pre-tokenizer and decoder."""
    tokenizer = Tokenizer(models.Unigram())
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    trainer = trainers.UnigramTrainer(
        vocab_size=300,
        special_tokens=["<unk>", "<s>", "</s>"],
        unk_token="<unk>",
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS * 5, trainer=trainer)
    return _wrap(tokenizer)


def wordpiece() -> PreTrainedTokenizerFast:
    """BERT style WordPiece, whose decode puts a space between tokens (special ones too)."""
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    trainer = trainers.WordPieceTrainer(
        vocab_size=300, special_tokens=["[UNK]", "[CLS]", "[SEP]"], show_progress=False
    )
    tokenizer.train_from_iterator(CORPUS * 5, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        clean_up_tokenization_spaces=False,
    )


KINDS: dict[str, Callable[[], PreTrainedTokenizerFast]] = {
    "byte_level_bpe": byte_level_bpe,
    "metaspace_bpe": metaspace_bpe,
    "metaspace_byte_fallback_bpe": metaspace_byte_fallback_bpe,
    "unigram_metaspace": unigram_metaspace,
    "byte_fallback_bpe": byte_fallback_bpe,
    "wordpiece": wordpiece,
}


def llama_like(vocab_size: int, corpus: list[str], special_tokens: list[str]) -> PreTrainedTokenizerFast:
    """A Metaspace byte-fallback BPE (Llama / Mistral style) of exactly ``vocab_size`` tokens, the
    ``special_tokens`` first (for a model whose embeddings have that many rows)."""
    tokenizer = Tokenizer(models.BPE(unk_token=special_tokens[0]))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tokenizer.decoder = decoders.Sequence(
        [decoders.ByteFallback(), decoders.Metaspace(replacement="▁", prepend_scheme="first")]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(BYTE_TOKENS),
        special_tokens=special_tokens,
        limit_alphabet=60,
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    spec = json.loads(_with_byte_fallback(tokenizer).to_str())
    spec["model"]["unk_token"] = special_tokens[0]
    vocab = spec["model"]["vocab"]
    filler = 0
    while len(vocab) < vocab_size:
        vocab.setdefault(f"▁x{filler}", len(vocab))
        filler += 1
    if len(vocab) != vocab_size:
        raise ValueError(f"the corpus gives {len(vocab)} tokens, more than {vocab_size}")
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
        eos_token=special_tokens[0],
        extra_special_tokens=special_tokens[1:],
        clean_up_tokenization_spaces=False,
    )
