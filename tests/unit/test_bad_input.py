"""Every bad input gets a one-line error naming the problem and a non-zero exit, never a traceback."""

import pytest

from specdec.cli import main
from specdec.decode import KSchedule, plain_generate, speculative_generate
from specdec.errors import InvalidRequest
from specdec.testing import tiny_llama
from specdec.proposers import PromptLookupProposer
from specdec.types import StopConditions


@pytest.mark.parametrize("args, message", [
    (["   "], "prompt is empty"),
    (["hi", "--max-new-tokens", "0"], "max_new_tokens must be >= 1"),
    (["hi", "--max-new-tokens", "-5"], "max_new_tokens must be >= 1"),
    (["hi", "--temperature", "-0.1"], "temperature must be 0 (greedy) or in"),
    (["hi", "--top-p", "0"], "top_p must be in (0, 1]"),
    (["hi", "--top-p", "1.5"], "top_p must be in (0, 1]"),
    (["hi", "--k", "0"], "k must be >= 1"),
    (["hi", "--k", "many"], "--k must be a positive integer or auto, got 'many'"),
    (["hi", "--target", "/no/such/model"], "model path not found: /no/such/model"),
])
def test_cli_reports_bad_input_in_one_line(capsys, args, message):
    assert main(["generate", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("specdec: error:") and message in err
    assert "\n" not in err and "Traceback" not in err


@pytest.mark.parametrize("weights, message", [
    (["--token-weight", "0", "--feature-weight", "0"], "not both 0"),
    (["--token-weight", "-1"], "must be >= 0"),
])
def test_train_eagle_refuses_loss_weights_that_train_nothing(tmp_path, capsys, weights, message):
    code = main(["train", "eagle", "--out", str(tmp_path / "d"), "--data", str(tmp_path), "--steps", "1", *weights])
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("specdec: error:") and message in err and "\n" not in err


def test_cli_refuses_draft_with_another_vocabulary(tmp_path, capsys):
    tiny_llama(seed=0, vocab_size=64).model.save_pretrained(tmp_path / "target")
    tiny_llama(seed=1, vocab_size=80).model.save_pretrained(tmp_path / "draft")
    code = main(["generate", "hi", "--method", "draft", "--target", str(tmp_path / "target"),
                 "--draft", str(tmp_path / "draft")])
    err = capsys.readouterr().err
    assert code == 2 and "draft vocabulary (80 tokens" in err and "(64 tokens" in err


def test_prompt_plus_max_new_tokens_beyond_context_is_refused(tiny_target):
    with pytest.raises(InvalidRequest, match="exceeds the model's context of 512"):
        plain_generate(tiny_target, [[1, 2, 3]], stop=StopConditions(max_new_tokens=510))


def test_token_ids_outside_vocabulary_are_refused(tiny_target):
    with pytest.raises(InvalidRequest, match="outside the vocabulary"):
        speculative_generate(tiny_target, PromptLookupProposer(), [[1, 2, 96]])
    with pytest.raises(InvalidRequest, match="outside the vocabulary"):
        plain_generate(tiny_target, [[-1, 2]])


def test_empty_token_prompt_is_refused(tiny_target):
    with pytest.raises(InvalidRequest, match="prompt 1 is empty"):
        plain_generate(tiny_target, [[1], []])


def test_adaptive_bounds_are_checked():
    with pytest.raises(InvalidRequest, match="k_min <= k <= k_max"):
        KSchedule(k=8, adaptive=True, k_max=4)
