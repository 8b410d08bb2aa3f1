import pytest

from specdec.errors import InvalidRequest
from specdec.stopping import StopChecker, cut_at_stop_string
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
