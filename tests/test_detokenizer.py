"""IncrementalDetokenizer on every tokenizer kind (``tests.tokenizer_kinds``), through both of its
decoders (tokenizers' DecodeStream and the windowed decode): the streamed text is the text the
prompt and the output decode to past the prompt's own."""

# ruff: noqa: RUF001

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import PreTrainedTokenizerFast

from gateway.detokenizer import IncrementalDetokenizer, decode_stream_fits, prompt_tail
from gateway.text_stream import TextStream
from pdserve.core.sampling import SamplingParams
from tests.tokenizer_kinds import KINDS, byte_fallback_bpe, byte_level_bpe, metaspace_bpe, wordpiece

FFFD = "\ufffd"
TEXTS = [
    "Hello world",
    " Hello  world, how are you?",
    "Café crème brûlée à Zürich",
    "中文测试，你好世界。",
    "日本語とEnglishの mix 😀!",
    "Emoji 👍🏽 family 👨‍👩‍👧 flag 🇫🇷 rocket🚀✨",
    "  two leading spaces\n\nand\ttabs",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 outside the BMP: 𐍈 𝄞",
]
ALPHABET = "abc xyz PFéàüñ中文日本語😀👍🏽🎉€ ,.!\n"
DECODERS = {"stream": True, "window": False}
TOKENIZERS = {name: build() for name, build in KINDS.items()}


@pytest.fixture(params=sorted(TOKENIZERS))
def tokenizer(request: pytest.FixtureRequest) -> PreTrainedTokenizerFast:
    return TOKENIZERS[request.param]


@pytest.fixture(params=sorted(DECODERS))
def use_stream(request: pytest.FixtureRequest) -> bool:
    return DECODERS[request.param]


def stream(
    detok: IncrementalDetokenizer, ids: Sequence[int], chunk_sizes: Sequence[int] = ()
) -> tuple[list[str], str]:
    """Feed ``ids`` in chunks (one token at a time by default); return the deltas and the flush."""
    deltas = []
    position = 0
    sizes = iter(chunk_sizes)
    while position < len(ids):
        size = next(sizes, 1)
        deltas.append(detok.add(ids[position : position + size]))
        position += size
    return deltas, detok.flush()


def expected_text(tok: PreTrainedTokenizerFast, prompt: list[int], output: list[int], skip: bool) -> str:
    """decode(prompt + output) past decode(prompt) (a split last character of the prompt aside)."""
    prompt_text = tok.decode(prompt, skip_special_tokens=skip).rstrip(FFFD)
    full = tok.decode(prompt + output, skip_special_tokens=skip)
    assert full.startswith(prompt_text)
    return full[len(prompt_text) :]


def rewrites_text(tok: PreTrainedTokenizerFast, prompt: list[int], output: list[int], skip: bool) -> bool:
    """Whether a token changes text decoded before it (then only best effort is promised)."""
    full = tok.decode(prompt + output, skip_special_tokens=skip)
    return any(
        not full.startswith(tok.decode(prompt + output[:k], skip_special_tokens=skip).rstrip(FFFD))
        for k in range(len(output) + 1)
    )


def encoded(tok: PreTrainedTokenizerFast, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


def specials(tok: PreTrainedTokenizerFast) -> list[int]:
    return sorted(set(tok.all_special_ids))


@st.composite
def prompt_and_output(
    draw: st.DrawFn, tok: PreTrainedTokenizerFast
) -> tuple[list[int], list[int], list[int]]:
    """A prompt (text, maybe special tokens), an output of text pieces, special tokens and any ids
    at all, and the chunk sizes the output arrives in."""
    words = st.text(alphabet=ALPHABET, min_size=1, max_size=12)
    prompt = encoded(tok, draw(words))
    if draw(st.booleans()):
        prompt = [*draw(st.lists(st.sampled_from(specials(tok)), max_size=2)), *prompt]
        prompt += draw(st.lists(st.sampled_from(specials(tok)), max_size=2))
    pieces = st.one_of(
        words.map(lambda text: encoded(tok, text)),
        st.lists(st.sampled_from(specials(tok)), min_size=1, max_size=3),
        st.lists(st.integers(0, len(tok) - 1), min_size=1, max_size=4),
    )
    output = [token for piece in draw(st.lists(pieces, min_size=1, max_size=6)) for token in piece]
    sizes = draw(st.lists(st.integers(1, 4), min_size=len(output), max_size=len(output)))
    return prompt, output, sizes


@pytest.mark.parametrize("kind", sorted(TOKENIZERS))
@pytest.mark.parametrize("decoder", sorted(DECODERS))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), skip=st.booleans())
def test_streamed_text_is_the_decode_past_the_prompt(
    kind: str, decoder: str, data: st.DataObject, skip: bool
) -> None:
    tok = TOKENIZERS[kind]
    prompt, output, sizes = data.draw(prompt_and_output(tok))
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip, use_decode_stream=DECODERS[decoder])
    deltas, tail = stream(detok, output, sizes)
    assert detok.text == "".join(deltas) + tail
    assert detok.token_ids == output
    if rewrites_text(tok, prompt, output, skip):
        return
    expected = expected_text(tok, prompt, output, skip)
    assert detok.text == expected
    if FFFD not in expected:
        assert all(FFFD not in delta for delta in deltas)
    assert not any(delta.endswith(FFFD) for delta in deltas)


@pytest.mark.parametrize("kind", sorted(TOKENIZERS))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), skip=st.booleans())
def test_stop_strings_apply_to_that_text(kind: str, data: st.DataObject, skip: bool) -> None:
    """The text stream cut at a stop string taken from the output's own text."""
    tok = TOKENIZERS[kind]
    prompt, output, _ = data.draw(prompt_and_output(tok))
    if rewrites_text(tok, prompt, output, skip):
        return
    text = expected_text(tok, prompt, output, skip)
    if not text.strip(FFFD):
        return
    start = data.draw(st.integers(0, len(text) - 1))
    stop = text[start : start + data.draw(st.integers(1, 4))]
    params = SamplingParams(stop=(stop,), skip_special_tokens=skip)
    stream_ = TextStream(tok, params, prompt)
    chunk = stream_.add(output)
    got = chunk.text
    if not chunk.stopped:
        end = stream_.finish()
        got += end.text
        assert end.stopped
    assert got == text[: text.index(stop)]


@pytest.mark.parametrize("kind", ["metaspace_bpe", "unigram_metaspace", "byte_fallback_bpe"])
def test_metaspace_first_token_keeps_its_leading_space(kind: str, use_stream: bool) -> None:
    """``▁Paris`` after the prompt is " Paris", as decode(prompt + output) has it."""
    tok = TOKENIZERS[kind]
    prompt = encoded(tok, "The capital of France is")
    output = encoded(tok, "Paris")
    assert tok.convert_ids_to_tokens(output)[0].startswith("▁")
    assert not tok.decode(output).startswith(" ")
    detok = IncrementalDetokenizer(tok, prompt, use_decode_stream=use_stream)
    deltas, tail = stream(detok, output)
    assert deltas[0].startswith(" ")
    assert "".join(deltas) + tail == " Paris"
    assert detok.text == tok.decode(prompt + output)[len(tok.decode(prompt)) :]


def test_without_a_prompt_the_first_token_decodes_alone(use_stream: bool) -> None:
    tok = TOKENIZERS["metaspace_bpe"]
    hello = tok.convert_tokens_to_ids("▁Hello")
    detok = IncrementalDetokenizer(tok, use_decode_stream=use_stream)
    assert detok.add([hello]) == "Hello"
    assert detok.add([hello]) == " Hello"
    assert detok.flush() == ""


@pytest.mark.parametrize("kind", ["byte_fallback_bpe", "metaspace_byte_fallback_bpe"])
def test_byte_fallback_pieces_make_one_character(kind: str, use_stream: bool) -> None:
    tok = TOKENIZERS[kind]
    euro = tok.convert_tokens_to_ids(["<0xE2>", "<0x82>", "<0xAC>"])
    prompt = encoded(tok, "It costs")
    detok = IncrementalDetokenizer(tok, prompt, use_decode_stream=use_stream)
    deltas, tail = stream(detok, [tok.convert_tokens_to_ids("▁"), *euro])
    assert deltas[-1].endswith("€")
    assert all(FFFD not in d for d in deltas)
    assert "".join(deltas) + tail == " €"


def test_a_character_split_between_prompt_and_output_goes_to_the_output(use_stream: bool) -> None:
    tok = TOKENIZERS["byte_level_bpe"]
    ids = encoded(tok, "ok 中文")
    cut = next(k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith(FFFD))
    detok = IncrementalDetokenizer(tok, ids[:cut], use_decode_stream=use_stream)
    deltas, tail = stream(detok, ids[cut:])
    assert "".join(deltas) + tail == tok.decode(ids)[len(tok.decode(ids[:cut]).rstrip(FFFD)) :]
    assert all(FFFD not in d for d in deltas)


def test_a_character_the_output_does_not_complete_stays_the_prompts(use_stream: bool) -> None:
    """The prompt ends inside a character and the output goes on with other text: decode(prompt)
    already ends with that character's U+FFFD, so the stream starts past it."""
    tok = TOKENIZERS["byte_level_bpe"]
    ids = encoded(tok, "ok 中文")
    cut = next(k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith(FFFD))
    prompt, output = ids[:cut], encoded(tok, "abc def")
    detok = IncrementalDetokenizer(tok, prompt, use_decode_stream=use_stream)
    deltas, tail = stream(detok, output)
    assert "".join(deltas) + tail == tok.decode(prompt + output)[len(tok.decode(prompt)) :]
    assert all(FFFD not in d for d in deltas)


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip_one_token_at_a_time(
    tokenizer: PreTrainedTokenizerFast, use_stream: bool, text: str
) -> None:
    ids = encoded(tokenizer, text)
    detok = IncrementalDetokenizer(tokenizer, use_decode_stream=use_stream)
    deltas, tail = stream(detok, ids)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)
    assert tail == ""
    assert all(FFFD not in delta for delta in deltas)


@pytest.mark.parametrize(
    ("text", "tokens", "window", "by_stream"),
    [
        (
            "ok 👍🏽!",
            ["o", "k", "ĠðŁĳ", "įðŁ", "ı", "½", "!"],
            ["o", "k", " ", "👍", "", "🏽", "!"],
            ["o", "k", "", "", "", " 👍🏽", "!"],
        ),
        (
            "ok 中文!",
            ["o", "k", "Ġ", "ä¸", "Ń", "æĸ", "ĩ", "!"],
            ["o", "k", " ", "", "中", "", "文", "!"],
            ["o", "k", " ", "", "中", "", "文", "!"],
        ),
    ],
)
def test_split_characters_exact_deltas(
    text: str, tokens: list[str], window: list[str], by_stream: list[str], use_stream: bool
) -> None:
    """A character waits for its last byte; the windowed decode gives out the text before it at once,
    the stream once the text no longer ends in an unfinished character."""
    tok = TOKENIZERS["byte_level_bpe"]
    ids = encoded(tok, text)
    assert tok.convert_ids_to_tokens(ids) == tokens
    deltas, tail = stream(IncrementalDetokenizer(tok, use_decode_stream=use_stream), ids)
    assert deltas == (by_stream if use_stream else window)
    assert tail == ""


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(skip: bool, use_stream: bool) -> None:
    tok = TOKENIZERS["byte_level_bpe"]
    eos = tok.eos_token_id
    ids = [*encoded(tok, "Hi"), eos, *encoded(tok, " there"), eos]
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip, use_decode_stream=use_stream)
    deltas, tail = stream(detok, ids)
    assert "".join(deltas) + tail == ("Hi there" if skip else "Hi<|endoftext|> there<|endoftext|>")


@pytest.mark.parametrize("spaces", [True, False])
def test_spaces_between_special_tokens(spaces: bool, use_stream: bool) -> None:
    """WordPiece decodes with a space between every two tokens; spaces_between_special_tokens off
    gives a special token after another one bare, as vLLM does for fast tokenizers."""
    tok = TOKENIZERS["wordpiece"]
    cls, sep = tok.cls_token_id, tok.sep_token_id
    prompt = encoded(tok, "Hello world")
    output = [sep, sep, *encoded(tok, "vu"), cls, sep]
    detok = IncrementalDetokenizer(
        tok,
        prompt,
        skip_special_tokens=False,
        spaces_between_special_tokens=spaces,
        use_decode_stream=use_stream,
    )
    deltas, tail = stream(detok, output)
    text = "".join(deltas) + tail
    if spaces:
        assert text == " [SEP] [SEP] vu [CLS] [SEP]"
        assert text == expected_text(tok, prompt, output, skip=False)
    else:
        assert text == " [SEP][SEP] vu [CLS][SEP]"
    skipped = IncrementalDetokenizer(tok, prompt, spaces_between_special_tokens=spaces)
    assert "".join(stream(skipped, output)[0]) == " vu"


def test_special_token_inside_a_split_character_is_skipped(use_stream: bool) -> None:
    tok = TOKENIZERS["byte_level_bpe"]
    ids = encoded(tok, "中")
    with_eos = [ids[0], tok.eos_token_id, *ids[1:]]
    detok = IncrementalDetokenizer(tok, use_decode_stream=use_stream)
    deltas, tail = stream(detok, with_eos)
    assert deltas[:-1] == [""] * (len(with_eos) - 1)
    assert deltas[-1] == "中"
    assert tail == ""


def test_flush_releases_an_unfinished_character(use_stream: bool) -> None:
    tok = TOKENIZERS["byte_level_bpe"]
    prompt = encoded(tok, "The fox")
    ids = encoded(tok, " ab😀")[:-1]
    detok = IncrementalDetokenizer(tok, prompt, use_decode_stream=use_stream)
    deltas, tail = stream(detok, ids)
    assert "".join(deltas) == " ab"
    assert tail == FFFD
    assert detok.flush() == ""


def test_byte_fallback_keeps_a_character_already_emitted(use_stream: bool) -> None:
    """A stray byte after a complete character changes the full decode of that character (ByteFallback
    turns a run of byte tokens with an invalid byte into one U+FFFD per byte); the stream has already
    sent it and keeps it (DecodeStream refuses to go on: the windowed decode takes over)."""
    tok = TOKENIZERS["byte_fallback_bpe"]
    ids = tok.convert_tokens_to_ids(["<0xE4>", "<0xB8>", "<0xAD>", "<0x80>", "▁Hello"])
    assert tok.decode(ids) == FFFD * 4 + " Hello"
    deltas, tail = stream(IncrementalDetokenizer(tok, use_decode_stream=use_stream), ids)
    assert deltas == ["", "", "中", "", FFFD * 3 + " Hello"]
    assert tail == ""


@pytest.mark.parametrize("seed", range(10))
def test_random_ids_byte_level(seed: int, use_stream: bool) -> None:
    """Byte-level BPE never rewrites text: any id sequence streams to exactly the full decode."""
    tok = TOKENIZERS["byte_level_bpe"]
    rng = random.Random(seed)
    prompt = encoded(tok, "Once upon")
    ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 60))]
    for skip in (True, False):
        detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip, use_decode_stream=use_stream)
        deltas, tail = stream(detok, ids, [rng.choice([1, 1, 2, 3]) for _ in ids])
        assert "".join(deltas) + tail == expected_text(tok, prompt, ids, skip)
        assert not any(delta.endswith(FFFD) for delta in deltas)


class RecordingDecoder:
    """A tokenizer that is not a fast one (the windowed decode), recording each decode's length."""

    def __init__(self, tokenizer: PreTrainedTokenizerFast) -> None:
        self.tokenizer = tokenizer
        self.lengths: list[int] = []

    def decode(self, token_ids: list[int], **options: bool) -> str:
        self.lengths.append(len(token_ids))
        text: str = self.tokenizer.decode(token_ids, skip_special_tokens=options["skip_special_tokens"])
        return text


def test_decode_window_stays_small(tokenizer: PreTrainedTokenizerFast) -> None:
    text = " ".join(TEXTS) * 5
    prompt = encoded(tokenizer, text)
    ids = encoded(tokenizer, text)
    assert len(ids) > 300
    recorder = RecordingDecoder(tokenizer)
    detok = IncrementalDetokenizer(recorder, prompt)
    assert not detok.uses_decode_stream
    deltas, tail = stream(detok, ids)
    assert "".join(deltas) + tail == expected_text(tokenizer, prompt, ids, skip=True)
    assert max(recorder.lengths) <= 40


def test_which_decoder_fits() -> None:
    assert decode_stream_fits(TOKENIZERS["byte_level_bpe"])
    assert not decode_stream_fits(RecordingDecoder(TOKENIZERS["byte_level_bpe"]))
    cleaning = wordpiece()
    cleaning.clean_up_tokenization_spaces = True
    assert not decode_stream_fits(cleaning)
    assert IncrementalDetokenizer(TOKENIZERS["metaspace_bpe"]).uses_decode_stream
    assert not IncrementalDetokenizer(cleaning).uses_decode_stream
    with pytest.raises(ValueError, match="DecodeStream"):
        IncrementalDetokenizer(cleaning, use_decode_stream=True)


def test_clean_up_tokenization_spaces_follows_decode() -> None:
    """A tokenizer that cleans up its text decodes by windows of its own decode: the text follows it."""
    cleaning = wordpiece()
    cleaning.clean_up_tokenization_spaces = True
    prompt = encoded(cleaning, "Hello world")
    output = encoded(cleaning, "vu , déjà !")
    detok = IncrementalDetokenizer(cleaning, prompt)
    deltas, tail = stream(detok, output)
    assert "".join(deltas) + tail == expected_text(cleaning, prompt, output, skip=True)


def test_prompt_tail_is_short_and_clean() -> None:
    tok = TOKENIZERS["byte_level_bpe"]
    ids = encoded(tok, "The quick brown fox jumps over the lazy dog")

    def decode(token_ids: list[int]) -> str:
        return str(tok.decode(token_ids, skip_special_tokens=True))

    assert prompt_tail(ids, decode) == ids[-4:]
    assert prompt_tail(ids[:2], decode) == ids[:2]
    assert prompt_tail([], decode) == []
    eos = tok.eos_token_id
    assert prompt_tail([*ids, eos, eos, eos, eos], decode) == [*ids[-1:], eos, eos, eos, eos]


def test_empty_add_and_empty_stream(use_stream: bool) -> None:
    detok = IncrementalDetokenizer(byte_level_bpe(), use_decode_stream=use_stream)
    assert detok.add([]) == ""
    assert detok.flush() == ""
    assert detok.text == ""


def test_add_after_flush_is_an_error(use_stream: bool) -> None:
    tok = TOKENIZERS["byte_level_bpe"]
    detok = IncrementalDetokenizer(tok, use_decode_stream=use_stream)
    detok.add(encoded(tok, "hi"))
    assert detok.flush() == ""
    with pytest.raises(RuntimeError):
        detok.add([0])
    assert detok.flush() == ""
    assert detok.text == "hi"
    assert detok.token_ids == encoded(tok, "hi")


def test_builders_cover_the_hard_cases() -> None:
    """The fixtures really split characters across tokens and drop a first token's leading space."""
    for tok in (byte_level_bpe(), byte_fallback_bpe()):
        # 𝄞 is in no training text: its bytes are tokens of their own whatever the trainer merged
        # (its ties fall differently from one process to the next).
        ids = encoded(tok, "中文😀👍🏽𝄞")
        assert any(tok.decode(ids[:k]).endswith(FFFD) for k in range(1, len(ids)))
    tok = metaspace_bpe()
    paris = encoded(tok, "Paris")
    assert tok.decode(encoded(tok, "is") + paris) == "is Paris"
    assert tok.decode(paris) == "Paris"
