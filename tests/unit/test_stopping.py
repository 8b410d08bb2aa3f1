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


# --- IncrementalText: a growing text decoded a few tokens at a time ------------------------------

def _byte_vocab():
    # Characters of 1-4 bytes split over tokens, an empty token (a skipped special), spaces.
    return {1: b"caf", 2: b"\xc3", 3: b"\xa9", 4: b" ", 5: b"\xf0\x9f", 6: b"\x98", 7: b"\x80", 8: b"",
            9: b"ok", 10: b"\xe2\x82\xac", 11: b".\n"}


def _random_pushes(seed: int, vocab_ids, n: int):
    import random

    rng = random.Random(seed)
    ids = [rng.choice(vocab_ids) for _ in range(n)]
    blocks, i = [], 0
    while i < len(ids):
        step = rng.randint(1, 6)  # a speculative step's tokens
        blocks.append(ids[i : i + step])
        i += step
    return ids, blocks


@pytest.mark.parametrize("leading_space_dropped", [False, True])
def test_incremental_text_is_the_whole_text_decoded_after_every_push(leading_space_dropped):
    from specdec.stopping import IncrementalText

    vocab = _byte_vocab()

    def detokenize(ids):
        text = b"".join(vocab[i] for i in ids).decode("utf-8", errors="replace")
        # A sentencepiece-style decoder drops the space that begins a text: decoding a window of
        # tokens on its own would lose the spaces that begin it.
        return text[1:] if leading_space_dropped and text.startswith(" ") else text

    decoded_tokens = []
    counting = lambda ids: decoded_tokens.append(len(ids)) or detokenize(ids)  # noqa: E731
    for seed in range(40):
        ids, blocks = _random_pushes(seed, list(vocab), 300)
        text, have = IncrementalText(counting, ids[:7]), ids[:7]
        for block in blocks:
            have = have + block
            assert text.push(block) == detokenize(have) == text.text, (seed, have)
    # It decoded a window per push, not the whole list: the cost does not grow with the length.
    assert max(decoded_tokens[40:]) < 60


def test_incremental_text_decodes_everything_again_when_the_context_is_rewritten():
    from specdec.stopping import IncrementalText

    # A detokenizer whose rendering of early text depends on a late token (beyond any window).
    def detokenize(ids):
        text = "".join(chr(97 + i % 26) for i in ids)
        return text.upper() if ids and ids[-1] == 99 else text

    text = IncrementalText(detokenize, list(range(40)))
    assert text.push([1, 2]) == detokenize(list(range(40)) + [1, 2])
    assert text.push([99]) == detokenize(list(range(40)) + [1, 2, 99])
