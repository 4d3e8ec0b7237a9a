"""Case api-stop-across-tokens: stop strings split across pushes never leak into the text."""

from __future__ import annotations

import pytest

from flare.runtime.stop_strings import StopStringMatcher


def _run(stops, pieces):
    """Push pieces until a stop; return (emitted text, stopped, per-push outputs)."""
    m = StopStringMatcher(stops)
    outs = []
    for p in pieces:
        out, stopped = m.push(p)
        outs.append(out)
        if stopped:
            return "".join(outs), True, outs
    outs.append(m.flush())
    return "".join(outs), False, outs


def test_stop_split_across_pushes():
    text, stopped, outs = _run(["END"], ["Hello E", "N", "D and more"])
    assert (text, stopped) == ("Hello ", True)
    # "E" and "EN" were held back, not emitted and later retracted.
    assert outs == ["Hello ", "", ""]


def test_double_newline_across_tokens():
    text, stopped, _ = _run(["\n\n"], ["line one.\n", "\nline two"])
    assert (text, stopped) == ("line one.", True)


def test_stop_at_very_start():
    assert _run(["END"], ["END"])[:2] == ("", True)
    assert _run(["END"], ["E", "ND", "x"])[:2] == ("", True)


def test_false_start_is_released():
    text, stopped, outs = _run(["END"], ["E", "N", "O", "UGH"])
    assert (text, stopped) == ("ENOUGH", False)
    assert outs == ["", "", "ENO", "UGH", ""]


def test_overlapping_candidates():
    # "EEN" + "D": the first "E" cannot start "END" once "EN" follows it.
    assert _run(["END"], ["xEE", "N", "D"])[:2] == ("xE", True)
    # Stop "ABAC" after "ABAB": only the second "AB" may still begin it.
    text, stopped, outs = _run(["ABAC"], ["ABAB", "AC"])
    assert (text, stopped) == ("AB", True)
    assert outs == ["AB", ""]


def test_multiple_stops_earliest_wins():
    assert _run(["END", "\n\n"], ["a\n\nb END"])[:2] == ("a", True)
    assert _run(["END", "\n\n"], ["a EN", "D\n\n"])[:2] == ("a ", True)
    # Held back for the longest candidate, released when neither completes.
    text, stopped, outs = _run(["STOP", "ST!"], ["go ST", "ay"])
    assert (text, stopped, outs[0]) == ("go STay", False, "go ")


def test_held_text_flushed_at_finish():
    m = StopStringMatcher(["END"])
    assert m.push("the EN") == ("the ", False)
    assert m.flush() == "EN"
    assert m.flush() == ""


def test_no_stops_passes_through():
    m = StopStringMatcher(["", ""])
    assert m.push("END") == ("END", False)
    assert m.flush() == ""


def test_after_stop_everything_dropped():
    m = StopStringMatcher(["END"])
    assert m.push("aENDb") == ("a", True)
    assert m.stopped
    assert m.push("more") == ("", True)
    assert m.flush() == ""


@pytest.mark.parametrize("split", range(1, 12))
def test_every_split_point(split):
    s = "abc END def"
    text, stopped, _ = _run(["END"], [s[:split], s[split:]])
    assert (text, stopped) == ("abc ", True)
