"""Every backend declares the model protocol (specdec.backends.base.ModelBackend), and what it
declares is what it does: the engine reads these declarations instead of probing types."""

import pytest
import torch

from specdec.backends.base import ModelBackend
from specdec.backends.subset_head import SubsetHeadLM
from specdec.errors import InvalidRequest
from specdec.models import wrap_model
from tests.conftest import gguf_copy

BACKENDS = ("hf", "fast", "fast-bf16", "llamacpp", "subset-head")


@pytest.fixture(scope="module")
def backends(tiny_target, tmp_path_factory):
    rows = torch.arange(0, tiny_target.vocab_size, 2)
    return {"hf": tiny_target, "fast": wrap_model(tiny_target.model, "tiny", "fast"),
            "fast-bf16": wrap_model(tiny_target.model, "tiny", "fast-bf16"),
            "llamacpp": gguf_copy(tiny_target, tmp_path_factory.mktemp("gguf") / "tiny.gguf"),
            "subset-head": SubsetHeadLM(tiny_target.model, rows, "tiny-subset")}


@pytest.mark.parametrize("which", BACKENDS)
def test_each_backend_declares_the_protocol_and_its_name(backends, which):
    lm = backends[which]
    assert isinstance(lm, ModelBackend)
    assert lm.backend == ("hf" if which == "subset-head" else which)
    assert (lm.head_rows is not None) == (which == "subset-head")
    if which == "subset-head":  # the declared rows are the only tokens it scores
        logits = lm.prefill(lm.new_cache(1), [[3, 5, 7]]).logits[0]
        assert torch.isfinite(logits).nonzero().flatten().tolist() == lm.head_rows.tolist()


@pytest.mark.parametrize("which", BACKENDS)
def test_declared_capabilities_are_what_the_backend_does(backends, which):
    lm = backends[which]
    prompt = [3, 5, 7, 11]
    cache = lm.new_cache(1)
    out = lm.prefill(cache, [prompt], want_hidden=True)
    assert lm.returns_hidden and out.hidden is not None and out.hidden.shape[-1] == lm.embedding_tables()[0].shape[1]
    # a tree block: two siblings after the prompt, each attending to the prompt and itself only
    block = torch.tensor([[[True, False], [False, True]]])
    ids = torch.tensor([[9, 10]])
    if lm.runs_trees:
        tree = lm.forward(cache, ids, block_mask=block, depth=torch.tensor([[0, 0]])).logits
        for j, t in enumerate((9, 10)):
            alone = lm.new_cache(1)
            lm.prefill(alone, [prompt])
            want = lm.forward(alone, torch.tensor([[t]])).logits[0, -1]
            torch.testing.assert_close(tree[0, j], want, atol=1e-4, rtol=1e-4)
    else:
        with pytest.raises(InvalidRequest, match="causal blocks only"):
            lm.forward(cache, ids, block_mask=block, depth=torch.tensor([[0, 0]]))
    if lm.greedy_steps:  # the backend's own argmax, equal to the argmax of its logits
        a, b = lm.new_cache(1), lm.new_cache(1)
        lm.prefill(a, [prompt])
        lm.prefill(b, [prompt])
        want = int(lm.forward(b, torch.tensor([[9]])).logits[0, -1].argmax())
        assert lm.greedy_step(a, 9) == want
    assert lm.stacks_caches == (which != "llamacpp")
    assert lm.output_bias() is None  # Llama's output layer has no bias
