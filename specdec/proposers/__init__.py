"""Proposers and their public registry. Importing this package registers the built-in ones."""

from specdec.proposers.base import PROPOSERS, Proposer, make_proposer, register
from specdec.proposers.draft_model import DraftModelProposer
from specdec.proposers.lookahead import LookaheadConfig, LookaheadProposer
from specdec.proposers.medusa import MedusaProposer
from specdec.proposers.prompt_lookup import PromptLookupProposer

__all__ = ["PROPOSERS", "Proposer", "make_proposer", "register", "DraftModelProposer", "PromptLookupProposer",
           "LookaheadConfig", "LookaheadProposer"]
