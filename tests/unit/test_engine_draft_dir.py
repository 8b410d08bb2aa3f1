"""--draft accepts a specdec draft directory (made by `specdec train draft`) as well as a model directory."""

import torch

from specdec.drafts import build_from_target, save_draft
from specdec.engine import Engine, EngineConfig
from specdec.models import LoadedModel
from specdec.types import StopConditions


def test_engine_loads_a_specdec_draft_directory_losslessly(tiny_target, tmp_path):
    save_draft(tmp_path / "d", build_from_target(tiny_target, [0]), torch.arange(40), {"target": "tiny"})
    engine = Engine.from_models(LoadedModel(tiny_target, None, "tiny"))
    from specdec.engine import _load_draft

    engine.draft = _load_draft(str(tmp_path / "d"), engine.target, EngineConfig())
    prompt = [[5, 17, 33, 2]]
    stop = StopConditions(max_new_tokens=16)
    spec = engine.generate_ids(prompt, method="draft", stop=stop, k=3)[0]
    plain = engine.generate_ids(prompt, method="plain", stop=stop)[0]
    assert spec.token_ids == plain.token_ids
    assert spec.stats.drafted > 0


def test_method_draft_without_draft_uses_the_shipped_one_or_asks_for_one(tiny_target):
    import pytest

    from specdec.errors import InvalidRequest

    engine = Engine.from_models(LoadedModel(tiny_target, None, "tiny"))
    with pytest.raises(InvalidRequest, match=f"no draft is shipped for the target '{tiny_target.name}': pass --draft"):
        engine.generate_ids([[5, 17, 33, 2]], method="draft", stop=StopConditions(max_new_tokens=4))
