"""TextStream: incremental detokenization never emits broken UTF-8; OpenAI stop strings (never
sent, matched across tokens, held back only while they may still match)."""

from __future__ import annotations

from moetier.serve.text import TextStream


class ByteTokenizer:
    """Token id = one byte; 256 = EOS (special, skipped)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def _ids(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def _run(text: str, stops: list[str], prompt: str = "> ") -> tuple[list[str], str, bool]:
    ts = TextStream(ByteTokenizer(), _ids(prompt), stops)
    pieces = [ts.push(t) for t in _ids(text)]
    pieces.append(ts.finish())
    return pieces, "".join(pieces), ts.stopped


def test_multibyte_characters_are_never_split() -> None:
    pieces, text, _ = _run("héllo wörld ✓ 🙂", [])
    assert text == "héllo wörld ✓ 🙂"
    assert all("\ufffd" not in p for p in pieces)
    assert pieces[1] == ""  # the first byte of é waits for the second


def test_stop_string_is_excluded_and_ends_the_stream() -> None:
    pieces, text, stopped = _run("To be, or not to be", ["not"])
    assert text == "To be, or " and stopped
    assert "n" not in "".join(pieces[:-1])[len("To be, or ") :]
    _, text, stopped = _run("abc", ["zz", "bc"])
    assert text == "a" and stopped


def test_partial_stop_is_held_then_released() -> None:
    ts = TextStream(ByteTokenizer(), [], ["END"])
    out = "".join(ts.push(t) for t in _ids("the EN"))
    assert out == "the " and not ts.stopped  # "EN" may become END
    out += "".join(ts.push(t) for t in _ids("D!"))
    assert out == "the " and ts.stopped
    ts2 = TextStream(ByteTokenizer(), [], ["END"])
    out2 = "".join(ts2.push(t) for t in _ids("the EN"))
    assert out2 + ts2.finish() == "the EN" and not ts2.stopped  # released when the sequence ends


def test_special_tokens_are_skipped_and_pushes_after_a_stop_are_ignored() -> None:
    ts = TextStream(ByteTokenizer(), [], ["x"])
    assert ts.push(256) == ""  # EOS: nothing
    assert ts.push(ord("a")) == "a"
    assert ts.push(ord("x")) == "" and ts.stopped
    assert ts.push(ord("b")) == "" and ts.finish() == ""
    assert ts.text == "a"
