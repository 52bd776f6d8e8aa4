"""StopStringMatcher: truncation before the first stop string, hold-back and release of lookalikes."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from gateway.stop_strings import StopStringMatcher


def run(stop: Sequence[str], deltas: Sequence[str]) -> tuple[list[tuple[str, bool]], str]:
    """Feed every delta; return what each feed returned and what flush released."""
    matcher = StopStringMatcher(stop)
    results = [matcher.feed(delta) for delta in deltas]
    return results, matcher.flush()


def reference(stop: Sequence[str], text: str) -> tuple[str, bool]:
    """Character by character: stop at the first position where any stop string is complete."""
    for end in range(1, len(text) + 1):
        starts = [end - len(s) for s in stop if text[:end].endswith(s)]
        if starts:
            return text[: min(starts)], True
    return text, False


def test_no_stop_strings_pass_text_through() -> None:
    results, tail = run([], ["Hello", " wor", "ld", ""])
    assert results == [("Hello", False), (" wor", False), ("ld", False), ("", False)]
    assert tail == ""


def test_text_without_any_stop_prefix_is_not_held() -> None:
    results, tail = run(["###"], ["Hello", " world"])
    assert results == [("Hello", False), (" world", False)]
    assert tail == ""


def test_stop_inside_one_delta() -> None:
    matcher = StopStringMatcher(["###"])
    assert matcher.feed("answer: 42###ignored") == ("answer: 42", True)
    assert matcher.stopped
    assert matcher.matched == "###"
    assert matcher.feed("more text") == ("", True)
    assert matcher.flush() == ""


def test_stop_spanning_two_deltas() -> None:
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("hello ST") == ("hello ", False)
    assert matcher.held == "ST"
    assert matcher.feed("OP and more") == ("", True)
    assert matcher.held == ""
    assert matcher.flush() == ""


def test_stop_spanning_many_deltas() -> None:
    results, tail = run(["</s>"], ["ok <", "/", "s", ">tail"])
    assert results == [("ok ", False), ("", False), ("", False), ("", True)]
    assert tail == ""


def test_stop_at_the_very_start() -> None:
    assert run(["User:"], ["User: hi"])[0] == [("", True)]
    results, _ = run(["User:"], ["Us", "er:", " hi"])
    assert results == [("", False), ("", True), ("", True)]


def test_earliest_stop_wins() -> None:
    matcher = StopStringMatcher(["world", "lo"])
    assert matcher.feed("hello world") == ("hel", True)
    assert matcher.matched == "lo"

    matcher = StopStringMatcher(["\n\n", "User:"])
    assert matcher.feed("Sure.\nUser: x\n\n") == ("Sure.\n", True)
    assert matcher.matched == "User:"


def test_stops_completing_at_the_same_character_prefer_the_earlier_start() -> None:
    matcher = StopStringMatcher(["bc", "abc"])
    assert matcher.feed("xabcd") == ("x", True)
    assert matcher.matched == "abc"


def test_first_completed_stop_wins_however_the_text_is_split() -> None:
    """ "bc" is complete before "abcd" is, in one delta or one character at a time."""
    whole, _ = run(["abcd", "bc"], ["xabcd"])
    assert whole == [("xa", True)]
    chars, _ = run(["abcd", "bc"], list("xabcd"))
    assert chars == [("x", False), ("", False), ("", False), ("a", True), ("", True)]


def test_lookalike_prefix_is_released_when_it_diverges() -> None:
    matcher = StopStringMatcher(["</answer>"])
    assert matcher.feed("a </ans") == ("a ", False)
    assert matcher.held == "</ans"
    assert matcher.feed("wer is 42") == ("</answer is 42", False)
    assert matcher.held == ""
    assert not matcher.stopped


def test_overlapping_lookalike_keeps_only_the_possible_start() -> None:
    matcher = StopStringMatcher(["aab"])
    assert matcher.feed("aaa") == ("a", False)
    assert matcher.held == "aa"
    assert matcher.feed("b!") == ("", True)


def test_flush_releases_held_text() -> None:
    matcher = StopStringMatcher(["END", "###"])
    assert matcher.feed("the EN") == ("the ", False)
    assert matcher.feed("d? #") == ("ENd? ", False)
    assert matcher.flush() == "#"
    assert matcher.flush() == ""


def test_held_text_is_shorter_than_the_longest_stop() -> None:
    matcher = StopStringMatcher(["aaaa", "b"])
    assert matcher.feed("aaa") == ("", False)
    assert matcher.held == "aaa"
    assert matcher.feed("a") == ("", True)


def test_unicode_stop_string() -> None:
    results, tail = run(["。"], ["你好", "世界。", "再见"])
    assert results == [("你好", False), ("世界", True), ("", True)]
    assert tail == ""


def test_duplicate_stop_strings_are_harmless() -> None:
    assert run(["x", "x"], ["abxcd"])[0] == [("ab", True)]


@pytest.mark.parametrize("stop", [[""], ["ok", ""]])
def test_empty_stop_string_is_rejected(stop: list[str]) -> None:
    with pytest.raises(ValueError, match="empty"):
        StopStringMatcher(stop)


def test_single_string_instead_of_a_list_is_rejected() -> None:
    with pytest.raises(TypeError):
        StopStringMatcher("stop")


@pytest.mark.parametrize("seed", range(300))
def test_random_streams_match_the_reference(seed: int) -> None:
    rng = random.Random(seed)
    alphabet = "ab c"
    stop = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(0, 3))]
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
    deltas = []
    position = 0
    while position < len(text):
        size = rng.randint(0, 5)
        deltas.append(text[position : position + size])
        position += size
    matcher = StopStringMatcher(stop)
    emitted = []
    stopped = False
    for delta in deltas:
        out, stopped = matcher.feed(delta)
        emitted.append(out)
        assert len(matcher.held) <= max((len(s) for s in stop), default=1) - 1
    emitted.append(matcher.flush())
    expected, expected_stopped = reference(stop, text)
    assert "".join(emitted) == expected
    assert stopped == expected_stopped
