"""IncrementalDetokenizer against offline-trained byte-level BPE and SentencePiece-style tokenizers."""

# ruff: noqa: RUF001

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from gateway.detokenizer import IncrementalDetokenizer

CORPUS = [
    "The quick brown fox jumps over the lazy dog. Hello world! How are you today?",
    "Café crème brûlée, naïve façade, señor, Zürich, Ærøskøbing, déjà vu, Ångström.",
    "中文测试，你好世界。日本語のテキスト、こんにちは。한국어 텍스트입니다.",
    "Emoji: 😀 🎉 👍🏽 👨‍👩‍👧 🇫🇷 ❤️ and more 🚀✨ in a sentence.",
    "  leading spaces and\ttabs\nnew lines\n\n  indented code: def f(x): return x + 1",
]

TEXTS = [
    "Hello world",
    " Hello  world, how are you?",
    "Café crème brûlée à Zürich",
    "中文测试，你好世界。",
    "日本語とEnglishの mix 😀!",
    "Emoji 👍🏽 family 👨‍👩‍👧 flag 🇫🇷 rocket🚀✨",
    "  two leading spaces\n\nand\ttabs",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 outside the BMP: 𐍈 𝄞",
    "zebra quiz 日本 ξ ж ☃ ✓",
]

ALPHABET = "abc xyz éàüñ中文日本語😀👍🏽🎉 ,.!\n"

BYTE_TOKENS = [f"<0x{b:02X}>" for b in range(256)]


def byte_level_bpe() -> PreTrainedTokenizerFast:
    """A GPT-2 style byte-level BPE with two special tokens."""
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


def _sentencepiece_like(
    setup: Callable[[Tokenizer], None],
) -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    setup(tokenizer)
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<unk>", "<s>", "</s>"],
        limit_alphabet=50,
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS * 5, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=_with_byte_fallback(tokenizer),
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        clean_up_tokenization_spaces=False,
    )


def llama_style() -> PreTrainedTokenizerFast:
    """Llama-2 style: "▁" for spaces, byte fallback, and one leading space stripped on decode."""

    def setup(tokenizer: Tokenizer) -> None:
        tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement="▁", prepend_scheme="never", split=True
        )
        tokenizer.decoder = decoders.Sequence(
            [
                decoders.Replace("▁", " "),
                decoders.ByteFallback(),
                decoders.Fuse(),
                decoders.Strip(" ", 1, 0),
            ]
        )

    return _sentencepiece_like(setup)


def metaspace_style() -> PreTrainedTokenizerFast:
    """Metaspace pre-tokenizer and decoder ("▁" prepended to the first word) with byte fallback."""

    def setup(tokenizer: Tokenizer) -> None:
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        tokenizer.decoder = decoders.Sequence(
            [decoders.ByteFallback(), decoders.Metaspace(replacement="▁", prepend_scheme="first")]
        )

    return _sentencepiece_like(setup)


BUILDERS = {"byte_level": byte_level_bpe, "llama": llama_style, "metaspace": metaspace_style}


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def tokenizer(request: pytest.FixtureRequest) -> PreTrainedTokenizerFast:
    return BUILDERS[request.param]()


@pytest.fixture(scope="module")
def byte_level() -> PreTrainedTokenizerFast:
    return byte_level_bpe()


@pytest.fixture(scope="module")
def llama() -> PreTrainedTokenizerFast:
    return llama_style()


def stream(
    detok: IncrementalDetokenizer, ids: Sequence[int], chunk_sizes: Sequence[int] | None = None
) -> tuple[list[str], str]:
    """Feed ``ids`` in chunks (one token at a time by default); return the deltas and the flush."""
    deltas = []
    position = 0
    sizes = iter(chunk_sizes or [])
    while position < len(ids):
        size = next(sizes, 1)
        deltas.append(detok.add(ids[position : position + size]))
        position += size
    return deltas, detok.flush()


def random_chunks(rng: random.Random, total: int) -> list[int]:
    sizes: list[int] = []
    while sum(sizes) < total:
        sizes.append(rng.choice([1, 1, 1, 2, 3, 5]))
    return sizes


def special_ids(tok: PreTrainedTokenizerFast) -> list[int]:
    return sorted(set(tok.all_special_ids))


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip_one_token_at_a_time(tokenizer: PreTrainedTokenizerFast, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    deltas, tail = stream(detok, ids)
    expected = tokenizer.decode(ids)
    assert expected.lstrip(" ") == text.lstrip(" ")
    assert "".join(deltas) == expected
    assert tail == ""
    assert detok.text == expected
    assert all("\ufffd" not in delta for delta in deltas)


@pytest.mark.parametrize("text", TEXTS)
def test_text_is_emitted_as_soon_as_the_prefix_decodes_cleanly(
    tokenizer: PreTrainedTokenizerFast, text: str
) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    for k, token in enumerate(ids, start=1):
        detok.add([token])
        prefix = tokenizer.decode(ids[:k])
        if prefix.endswith("\ufffd"):
            assert "\ufffd" not in detok.text
        else:
            assert detok.text == prefix


def test_multibyte_characters_really_are_split_across_tokens(tokenizer: PreTrainedTokenizerFast) -> None:
    """The fixtures exercise the hard case: a prefix of the ids decodes to a partial character."""
    ids = tokenizer.encode("中文😀👍🏽", add_special_tokens=False)
    partial = [k for k in range(1, len(ids)) if tokenizer.decode(ids[:k]).endswith("\ufffd")]
    assert partial
    detok = IncrementalDetokenizer(tokenizer)
    deltas, tail = stream(detok, ids)
    assert all("\ufffd" not in deltas[k - 1] for k in partial)
    assert "".join(deltas) + tail == "中文😀👍🏽"


@pytest.mark.parametrize(
    ("text", "tokens", "expected"),
    [
        (
            "ok 👍🏽!",
            ["o", "k", "ĠðŁĳ", "įðŁ", "ı", "½", "!"],
            ["o", "k", " ", "👍", "", "🏽", "!"],
        ),
        (
            "ok 中文!",
            ["o", "k", "Ġ", "ä¸", "Ń", "æĸ", "ĩ", "!"],
            ["o", "k", " ", "", "中", "", "文", "!"],
        ),
    ],
)
def test_split_characters_exact_deltas(
    byte_level: PreTrainedTokenizerFast, text: str, tokens: list[str], expected: list[str]
) -> None:
    """Text before an unfinished character goes out at once; the character waits for its last byte."""
    ids = byte_level.encode(text, add_special_tokens=False)
    assert byte_level.convert_ids_to_tokens(ids) == tokens
    detok = IncrementalDetokenizer(byte_level)
    deltas, tail = stream(detok, ids)
    assert deltas == expected
    assert tail == ""


@pytest.mark.parametrize("text", TEXTS)
def test_byte_level_emits_everything_but_the_unfinished_character(
    byte_level: PreTrainedTokenizerFast, text: str
) -> None:
    ids = byte_level.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(byte_level)
    for k, token in enumerate(ids, start=1):
        detok.add([token])
        assert detok.text == byte_level.decode(ids[:k]).rstrip("\ufffd")


def test_leading_spaces_are_kept_between_tokens(llama: PreTrainedTokenizerFast) -> None:
    text = "Hello world, how are you today?"
    ids = llama.encode(text, add_special_tokens=False)
    tokens = llama.convert_ids_to_tokens(ids)
    assert any(t.startswith("▁") and len(t) > 1 for t in tokens[1:])
    assert "".join(llama.decode([i]) for i in ids) != text
    detok = IncrementalDetokenizer(llama)
    deltas, tail = stream(detok, ids)
    assert "".join(deltas) + tail == text
    assert any(d.startswith(" ") for d in deltas)


def test_leading_space_of_first_token_follows_decode(llama: PreTrainedTokenizerFast) -> None:
    hello = llama.convert_tokens_to_ids("▁Hello")
    assert llama.convert_ids_to_tokens([hello]) == ["▁Hello"]
    assert llama.decode([hello, hello]) == "Hello Hello"
    detok = IncrementalDetokenizer(llama)
    assert detok.add([hello]) == "Hello"
    assert detok.add([hello]) == " Hello"
    assert detok.flush() == ""


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(byte_level: PreTrainedTokenizerFast, skip: bool) -> None:
    eos = byte_level.eos_token_id
    ids = [
        *byte_level.encode("Hi", add_special_tokens=False),
        eos,
        *byte_level.encode(" there", add_special_tokens=False),
        eos,
    ]
    detok = IncrementalDetokenizer(byte_level, skip_special_tokens=skip)
    deltas, tail = stream(detok, ids)
    expected = "Hi there" if skip else "Hi<|endoftext|> there<|endoftext|>"
    assert "".join(deltas) + tail == expected
    assert detok.text == expected


def test_special_tokens_skipped_sentencepiece(llama: PreTrainedTokenizerFast) -> None:
    eos, bos = llama.eos_token_id, llama.bos_token_id
    ids = [bos, *llama.encode("Hello world", add_special_tokens=False), eos]
    detok = IncrementalDetokenizer(llama)
    deltas, tail = stream(detok, ids)
    assert "".join(deltas) + tail == "Hello world"


def test_special_token_inside_a_split_character_is_skipped(byte_level: PreTrainedTokenizerFast) -> None:
    ids = byte_level.encode("中", add_special_tokens=False)
    assert len(ids) >= 2
    with_eos = [ids[0], byte_level.eos_token_id, *ids[1:]]
    detok = IncrementalDetokenizer(byte_level)
    deltas, tail = stream(detok, with_eos)
    assert deltas[:-1] == [""] * (len(with_eos) - 1)
    assert deltas[-1] == "中"
    assert tail == ""


def test_flush_releases_an_unfinished_character(byte_level: PreTrainedTokenizerFast) -> None:
    ids = byte_level.encode("ab😀", add_special_tokens=False)
    cut = ids[:-1]
    assert byte_level.decode(cut).endswith("\ufffd")
    detok = IncrementalDetokenizer(byte_level)
    deltas, tail = stream(detok, cut)
    assert "".join(deltas) == "ab"
    assert tail.endswith("\ufffd")
    assert "".join(deltas) + tail == byte_level.decode(cut)
    assert detok.flush() == ""


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("skip", [True, False])
def test_random_ids_byte_level(byte_level: PreTrainedTokenizerFast, seed: int, skip: bool) -> None:
    """Any id sequence, valid UTF-8 or not, streams to exactly the full decode."""
    rng = random.Random(seed)
    ids = [rng.randrange(len(byte_level)) for _ in range(rng.randrange(1, 60))]
    detok = IncrementalDetokenizer(byte_level, skip_special_tokens=skip)
    deltas, tail = stream(detok, ids, random_chunks(rng, len(ids)))
    assert "".join(deltas) + tail == byte_level.decode(ids, skip_special_tokens=skip)
    assert not any(delta.endswith("\ufffd") for delta in deltas)


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("skip", [True, False])
def test_random_text_with_special_tokens(tokenizer: PreTrainedTokenizerFast, seed: int, skip: bool) -> None:
    """Generated-looking streams: encoded words with special tokens in between, in random chunks."""
    rng = random.Random(seed)
    ids: list[int] = []
    for _ in range(rng.randrange(1, 8)):
        word = "".join(rng.choice(ALPHABET) for _ in range(rng.randrange(1, 10)))
        ids.extend(tokenizer.encode(word, add_special_tokens=False))
        if rng.random() < 0.4:
            ids.append(rng.choice(special_ids(tokenizer)))
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip)
    deltas, tail = stream(detok, ids, random_chunks(rng, len(ids)))
    expected = tokenizer.decode(ids, skip_special_tokens=skip)
    assert "".join(deltas) + tail == expected
    assert detok.text == expected
    assert all("\ufffd" not in delta for delta in deltas)


@pytest.mark.parametrize("seed", range(20))
def test_random_ids_with_special_tokens_anywhere_when_skipped(
    tokenizer: PreTrainedTokenizerFast, seed: int
) -> None:
    rng = random.Random(seed)
    text = "".join(rng.choice(ALPHABET) for _ in range(rng.randrange(1, 30)))
    ids = tokenizer.encode(text, add_special_tokens=False)
    for _ in range(rng.randrange(1, 4)):
        ids.insert(rng.randrange(len(ids) + 1), rng.choice(special_ids(tokenizer)))
    detok = IncrementalDetokenizer(tokenizer)
    deltas, tail = stream(detok, ids, random_chunks(rng, len(ids)))
    assert "".join(deltas) + tail == tokenizer.decode(ids, skip_special_tokens=True)
    assert all("\ufffd" not in delta for delta in deltas)


@pytest.mark.parametrize("seed", range(40))
def test_random_ids_sentencepiece(tokenizer: PreTrainedTokenizerFast, seed: int) -> None:
    """Random ids: exact whenever the full decode is clean; never a trailing U+FFFD from add()."""
    rng = random.Random(seed)
    ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 40))]
    detok = IncrementalDetokenizer(tokenizer)
    deltas, tail = stream(detok, ids, random_chunks(rng, len(ids)))
    expected = tokenizer.decode(ids, skip_special_tokens=True)
    if "\ufffd" not in expected:
        assert "".join(deltas) + tail == expected
    assert not any(delta.endswith("\ufffd") for delta in deltas)


def test_byte_fallback_keeps_a_character_already_emitted(llama: PreTrainedTokenizerFast) -> None:
    """ByteFallback decodes a run of byte tokens with any invalid byte as one U+FFFD per byte, so a
    stray byte after a complete character changes the full decode of that character; the stream has
    already sent it and keeps it."""
    ids = llama.convert_tokens_to_ids(["<0xE4>", "<0xB8>", "<0xAD>", "<0x80>", "▁Hello"])
    assert llama.decode(ids) == "\ufffd" * 4 + " Hello"
    detok = IncrementalDetokenizer(llama)
    deltas, tail = stream(detok, ids)
    assert deltas == ["", "", "中", "", "\ufffd\ufffd\ufffd Hello"]
    assert tail == ""


class RecordingDecoder:
    """Wraps a tokenizer and records the length of every id list it is asked to decode."""

    def __init__(self, tokenizer: PreTrainedTokenizerFast) -> None:
        self.tokenizer = tokenizer
        self.lengths: list[int] = []

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        self.lengths.append(len(token_ids))
        text: str = self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
        return text


def test_decode_window_stays_small(tokenizer: PreTrainedTokenizerFast) -> None:
    text = " ".join(TEXTS) * 5
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > 300
    recorder = RecordingDecoder(tokenizer)
    detok = IncrementalDetokenizer(recorder)
    deltas, tail = stream(detok, ids)
    assert "".join(deltas) + tail == text
    assert max(recorder.lengths) <= 8
    assert len(recorder.lengths) <= 2 * len(ids) + 1


def test_empty_add_and_empty_stream(byte_level: PreTrainedTokenizerFast) -> None:
    detok = IncrementalDetokenizer(byte_level)
    assert detok.add([]) == ""
    assert detok.flush() == ""
    assert detok.text == ""


def test_add_after_flush_is_an_error(byte_level: PreTrainedTokenizerFast) -> None:
    detok = IncrementalDetokenizer(byte_level)
    detok.add(byte_level.encode("hi", add_special_tokens=False))
    assert detok.flush() == ""
    with pytest.raises(RuntimeError):
        detok.add([0])
    assert detok.flush() == ""
    assert detok.text == "hi"
    assert detok.token_ids == byte_level.encode("hi", add_special_tokens=False)
