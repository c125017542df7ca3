"""Stop strings are matched on text, across token boundaries, and held back while undecided."""

from __future__ import annotations

from tilepd.router.stops import StopStringMatcher


def _stream(matcher: StopStringMatcher, pieces: list[str]) -> tuple[str, list[str]]:
    sent: list[str] = []
    for piece in pieces:
        matcher.feed(piece)
        sent.append(matcher.sendable(matcher.hit is not None))
        if matcher.hit:
            break
    else:
        sent.append(matcher.sendable(True))
    return "".join(sent), sent


def test_stop_spanning_three_tokens_is_cut_and_never_sent() -> None:
    m = StopStringMatcher(["STOP"])
    text, sent = _stream(m, ["hello S", "T", "OP and more"])
    assert text == "hello "
    assert m.hit is not None and m.hit.stop == "STOP"
    assert all("S" not in s for s in sent)


def test_held_back_text_is_released_when_it_does_not_start_a_stop() -> None:
    m = StopStringMatcher(["STOP"])
    m.feed("abcST")
    assert m.sendable(False) == "ab"  # the last len("STOP") - 1 characters wait
    m.feed("x")
    assert m.sendable(False) == "c"
    assert m.sendable(True) == "STx"


def test_include_stop_str_in_output_keeps_the_stop_and_holds_nothing_back() -> None:
    m = StopStringMatcher(["END"], include_in_output=True)
    m.feed("abcE")
    assert m.sendable(False) == "abcE"
    m.feed("ND tail")
    assert m.hit is not None and m.text == "abcEND"
    assert m.sendable(True) == "ND"


def test_earliest_completing_stop_wins() -> None:
    m = StopStringMatcher(["world", "lo w"])
    m.feed("hello world")
    assert m.hit is not None and m.hit.stop == "lo w" and m.text == "hel"


def test_stop_at_very_start_and_no_stops() -> None:
    m = StopStringMatcher(["\n"])
    m.feed("\nabc")
    assert m.text == "" and m.sendable(True) == ""
    plain = StopStringMatcher([])
    plain.feed("abc")
    assert plain.sendable(False) == "abc" and plain.hit is None


def test_match_is_not_searched_again_in_old_text() -> None:
    m = StopStringMatcher(["ab"])
    m.feed("xa")
    m.feed("b")
    assert m.hit is not None and m.text == "x"


def test_decode_stream_lines_parse_fast_and_exactly() -> None:
    from tilepd.router.backends import parse_line

    assert parse_line(b'{"token": 42}') == {"token": 42}
    assert parse_line(b'{"token": 42, "extra": 1}') == {"token": 42, "extra": 1}
    done = b'{"done": true, "finish_reason": "stop", "completion_tokens": 3, "timings": {}}'
    assert parse_line(done)["finish_reason"] == "stop"
