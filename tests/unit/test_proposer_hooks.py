"""The loop's hooks for target-side proposers: aux inputs scored in the verification forward
(Lookahead's window) and the target's hidden state handed to the proposer (Medusa heads)."""

import torch

from specdec.decode import plain_generate, speculative_generate
from specdec.proposers import Proposer
from specdec.types import AuxBlock, Proposal, StopConditions
from tests.conftest import assert_greedy_equal

PROMPT = [7, 3, 19, 42, 5]


class AuxProbe:
    """Drafts nothing real (a fixed wrong token) but asks for two aux inputs after the root:
    a chain [a1, a2] attending to the root. Records what comes back."""

    name = "aux_probe"
    needs_hidden = False

    def __init__(self):
        self.seen = []  # (committed tokens, aux logits)
        self.last = None

    def propose(self, ctx):
        props = []
        for toks in ctx.token_ids:
            aux_ids = (toks[-1] % 90 + 1, toks[-1] % 80 + 2)
            # columns: root, 1 candidate, aux0, aux1
            mask = torch.tensor([[1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
            props.append(Proposal(token_ids=(95,), aux=AuxBlock(aux_ids, mask, (1, 2))))
            self.last = (toks, aux_ids)
        return props

    def observe(self, verdicts):
        self.seen.append((self.last, verdicts[0].aux_logits))


class HiddenProbe(Proposer):
    name = "hidden_probe"
    needs_hidden = True

    def __init__(self):
        self.seen = []

    def propose(self, ctx):
        self.seen.append((ctx.token_ids[0], ctx.target_hidden[0]))
        return [Proposal() for _ in ctx.row_ids]

    def observe(self, verdicts):
        pass


def test_aux_inputs_get_their_own_logits_and_leave_output_unchanged(tiny_target):
    stop = StopConditions(max_new_tokens=12)
    want = plain_generate(tiny_target, [PROMPT], stop=stop)[0].token_ids
    probe = AuxProbe()
    got = speculative_generate(tiny_target, probe, [PROMPT], stop=stop, k=1)[0].token_ids
    assert_greedy_equal(tiny_target, PROMPT, got, want)
    for (toks, aux_ids), aux_logits in probe.seen[:4]:
        ref = tiny_target.forward(tiny_target.new_cache(1), torch.tensor([[*toks, *aux_ids]])).logits[0]
        assert torch.allclose(aux_logits, ref[-2:], atol=1e-4)


def test_hidden_state_is_the_one_that_produced_the_last_token(tiny_target):
    probe = HiddenProbe()
    speculative_generate(tiny_target, probe, [PROMPT], stop=StopConditions(max_new_tokens=6), k=2)
    for toks, hidden in probe.seen:
        ref = tiny_target.forward(tiny_target.new_cache(1), torch.tensor([list(toks[:-1])]), want_hidden=True)
        assert torch.allclose(hidden, ref.hidden[0, -1], atol=1e-5)
        with torch.inference_mode():
            assert int(tiny_target.model.lm_head(hidden).argmax()) == toks[-1]
