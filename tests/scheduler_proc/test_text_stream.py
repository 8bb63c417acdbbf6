"""TextStream: text cut before the first stop string, held back while it may start one."""
from __future__ import annotations

from spmd_runtime.scheduler_proc.text_stream import TextStream


class CharTokenizer:
    """One token per character (its code point)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(map(chr, ids))


def feed(stream: TextStream, text: str, final_at_end: bool = True) -> list[str]:
    ids = [ord(c) for c in text]
    return [stream.add([token], final_at_end and i == len(ids) - 1)
            for i, token in enumerate(ids)]


def test_a_stop_string_split_across_tokens_is_cut_and_nothing_after_it_is_sent() -> None:
    stream = TextStream(CharTokenizer(), ("END", "xyz"))
    pieces = feed(stream, "abEN dEND more", final_at_end=False)
    assert "".join(pieces) == "abEN d" and stream.stopped
    assert stream.add([ord("z")], True) == ""


def test_held_back_text_is_released_when_it_cannot_start_a_stop_or_at_the_end() -> None:
    stream = TextStream(CharTokenizer(), ("END",))
    assert feed(stream, "aE", final_at_end=False) == ["a", ""]
    assert stream.add([ord("x")], False) == "Ex"
    assert stream.add([ord("E")], True) == "E" and not stream.stopped
