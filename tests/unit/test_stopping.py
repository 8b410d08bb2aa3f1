import pytest

from specdec.errors import InvalidRequest
from specdec.stopping import StopChecker, TextStream, cut_at_stop_string
from specdec.types import StopConditions


def test_eos_in_the_middle_of_a_block_cuts_after_it():
    c = StopChecker(StopConditions(max_new_tokens=10, eos_token_ids=(2,)))
    assert c.push([5, 2, 7, 8]) == [5, 2]
    assert c.finish_reason == "stop"


def test_max_new_tokens_cuts_a_block():
    c = StopChecker(StopConditions(max_new_tokens=3))
    assert c.push([5, 6]) == [5, 6] and c.finish_reason is None
    assert c.push([7, 8, 9]) == [7]
    assert c.finish_reason == "length"


def test_stop_string_stops_at_the_token_completing_it():
    vocab = {1: "Hel", 2: "lo", 3: " wor", 4: "ld", 5: "!"}
    c = StopChecker(StopConditions(max_new_tokens=10, stop_strings=("o wo",)),
                    detokenize=lambda ids: "".join(vocab[i] for i in ids))
    assert c.push([1, 2, 3, 4, 5]) == [1, 2, 3]
    assert c.finish_reason == "stop"


def test_cut_at_stop_string_removes_it_and_the_rest():
    assert cut_at_stop_string("a: 1\nb: 2\n###\nc", ("###", "\nb")) == "a: 1"


@pytest.mark.parametrize("kwargs", [{"max_new_tokens": 0}, {"max_new_tokens": -3}, {"stop_strings": ("",)}])
def test_bad_stop_conditions_are_refused(kwargs):
    with pytest.raises(InvalidRequest):
        StopConditions(**kwargs)


# --- TextStream: the answer's text as it is accepted (specdec generate streams it) -----------

def _pieces(vocab, token_blocks, stop_strings=()):
    stream = TextStream(lambda ids: b"".join(vocab[i] for i in ids).decode("utf-8", errors="replace"),
                        stop_strings)
    pieces = [stream.push(block) for block in token_blocks]
    return pieces, stream.finish()


def test_text_stream_pieces_add_up_to_the_text():
    vocab = {1: b"Hel", 2: b"lo", 3: b" wor", 4: b"ld", 5: b"!"}
    pieces, rest = _pieces(vocab, [[1], [2, 3], [4], [5]])
    assert pieces == ["Hel", "lo wor", "ld", "!"] and rest == ""


def test_text_stream_holds_back_a_character_until_its_last_byte():
    vocab = {1: b"caf", 2: b"\xc3", 3: b"\xa9", 4: b"!"}  # "é" is two bytes, split over two tokens
    pieces, rest = _pieces(vocab, [[1], [2], [3], [4]])
    assert pieces == ["caf", "", "é", "!"] and rest == ""


def test_text_stream_holds_back_what_may_become_a_stop_string_and_never_shows_it():
    vocab = {1: b"a: 1\n", 2: b"#", 3: b"#", 4: b"#", 5: b"\nmore"}
    pieces, rest = _pieces(vocab, [[1], [2], [3], [4], [5]], stop_strings=("###",))
    assert pieces == ["a: 1\n", "", "", "", ""] and rest == ""


def test_text_stream_releases_a_held_back_tail_that_did_not_become_a_stop_string():
    vocab = {1: b"x #", 2: b"# y"}
    pieces, rest = _pieces(vocab, [[1], [2]], stop_strings=("###",))
    assert "".join(pieces) + rest == "x ## y" and pieces[0] == "x "


def test_text_stream_gives_the_rest_at_the_end():
    vocab = {1: b"ok", 2: b"\xc3"}  # ends on an incomplete character: shown as decoded at the end
    pieces, rest = _pieces(vocab, [[1, 2]])
    assert pieces == ["ok"] and rest == "\ufffd"
