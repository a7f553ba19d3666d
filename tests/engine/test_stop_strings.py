"""`find_stop`: where the earliest stop string completed by the newest characters begins."""

import pytest

from jaxserve.engine.stop_strings import find_stop

pytestmark = pytest.mark.quick  # seconds, no engine: `pytest -m quick`


@pytest.mark.parametrize("text, new_len, stops, expected", [
    # "world" is new; "wor" starts at index 6 of "hello world".
    ("hello world", 5, ["wor"], 6),
    # The whole text is new: the stop at the very start is found.
    ("STOPx", 5, ["STOP"], 0),
    # No stop string anywhere.
    ("hello world", 5, ["xyz"], None),
    ("hello world", 5, [], None),
])
def test_simple_cases(text, new_len, stops, expected):
    assert find_stop(text, new_len, stops) == expected


@pytest.mark.parametrize("stops", [["<a>", "<b>"], ["<b>", "<a>"]])
def test_earliest_of_several_stops_whatever_their_order(stops):
    # "xx" is old; "<a>yy<b>" is new: "<a>" begins at 2, "<b>" at 7.
    assert find_stop("xx<a>yy<b>", 8, stops) == 2


def test_earliest_occurrence_of_one_stop_inside_the_new_text():
    # All new: "STOP" occurs at 2 and at 9.
    assert find_stop("a STOP b STOP", 13, ["STOP"]) == 2


def test_stop_straddling_old_and_new_text_is_found():
    # Old "The qui", new "ck": "quick" (index 4) is completed only by the new characters.
    assert find_stop("The quick", 2, ["quick"]) == 4
    # Old "ab", new "c": the single new character completes "abc" at 0.
    assert find_stop("abc", 1, ["abc"]) == 0


def test_stop_only_in_old_text_is_not_reported_again():
    # "STOP" lies wholly in the old text "ab STOP "; the new "cd" cannot have changed it.
    assert find_stop("ab STOP cd", 2, ["STOP"]) is None
    # It ends exactly where the new text begins: still old.
    assert find_stop("abSTOPx", 1, ["STOP"]) is None


def test_a_new_occurrence_is_reported_not_the_old_one():
    # Old "STOP..ST", new "OP": the old "STOP" at 0 is skipped, the new one at 6 found.
    assert find_stop("STOP..STOP", 2, ["STOP"]) == 6


def test_overlapping_stops():
    # Old "xabc" already held "abc" (index 1); the new "d" completes only "bcd" (index 2).
    assert find_stop("xabcd", 1, ["abc", "bcd"]) == 2
    # Both "abcd" (index 1) and "bcd" (index 2) end at the new "d": the earlier wins.
    assert find_stop("xabcd", 1, ["bcd", "abcd"]) == 1
    # A stop overlapping itself: old "aa" held "aa" at 0; the new "a" completes "aa" at 1.
    assert find_stop("aaa", 1, ["aa"]) == 1
    # One stop a prefix of another, both completed by the new text "abc": both begin at 1.
    assert find_stop("xabc", 3, ["abc", "ab"]) == 1


@pytest.mark.parametrize("text", ["", "STOP", "hello STOP"])
def test_empty_new_text_finds_nothing(text):
    assert find_stop(text, 0, ["STOP"]) is None
