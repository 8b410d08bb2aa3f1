"""One registry of decoding methods: the CLI, the engine and the target service all read it."""

import argparse

import pytest

from specdec.engine import Engine, EngineConfig
from specdec.errors import InvalidRequest
from specdec.models import LoadedModel
from specdec.proposers import PROPOSERS, Proposer, method_names
from specdec.types import StopConditions
from target_service.core import discover_methods
from tests.conftest import assert_greedy_equal


def _generate_choices():
    from specdec.cli import build_parser

    subs = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return next(a.choices for a in subs.choices["generate"]._actions if a.dest == "method")


def test_cli_method_choices_are_the_registry():
    assert list(_generate_choices()) == ["auto", *method_names()]  # auto: the engine picks one of them
    assert set(method_names()) == {"plain", "draft", "prompt-lookup", "medusa", "lookahead", "eagle", "eagle-lookup"}


def test_every_registered_proposer_says_whether_it_needs_the_hidden_state(tiny_target, tiny_draft, tmp_path):
    engine = Engine.from_models(LoadedModel(tiny_target, None, "tiny"), LoadedModel(tiny_draft, None, "draft"),
                                EngineConfig(cost_cache=tmp_path))
    for name in ("draft", "prompt-lookup", "lookahead"):
        proposer = engine.proposer_factory(name)()
        assert isinstance(proposer, Proposer) and proposer.needs_hidden is False, name


@pytest.mark.parametrize("method", ["draft", "prompt-lookup", "lookahead"])
def test_engine_methods_from_the_registry_equal_plain(tiny_target, tiny_draft, tmp_path, method):
    engine = Engine.from_models(LoadedModel(tiny_target, None, "tiny"), LoadedModel(tiny_draft, None, "draft"),
                                EngineConfig(cost_cache=tmp_path))
    prompt, stop = [5, 17, 33, 2, 40], StopConditions(max_new_tokens=16, eos_token_ids=(10_000,))
    [want] = engine.generate_ids([prompt], "plain", stop=stop)
    [got] = engine.generate_ids([prompt], method, stop=stop, k=3)
    assert_greedy_equal(tiny_target, prompt, got.token_ids, want.token_ids)


def test_unknown_method_is_refused(tiny_target, tmp_path):
    engine = Engine.from_models(LoadedModel(tiny_target, None, "tiny"), config=EngineConfig(cost_cache=tmp_path))
    with pytest.raises(InvalidRequest):
        engine.generate_ids([[1, 2]], "prompt_lookup")


def test_target_service_offers_every_method_that_loads_without_a_draft(tiny_target):
    # No draft runs on the target service, the tiny target has no Medusa heads, and the service's
    # Decode hands proposers no target features (EAGLE reads them).
    assert set(discover_methods(tiny_target)) == set(PROPOSERS) - {"draft", "medusa", "eagle", "eagle-lookup"}
