"""Proposers and the public registry of methods. Importing this package registers the built-in ones."""

from specdec.proposers.base import (PLAIN, PROPOSERS, Proposer, ProposerEnv, ProposerFactory, check_runs,
                                    load_proposer, method_names, needs_trees, register)
from specdec.proposers.draft_model import DraftModelProposer, DraftRows
from specdec.proposers.eagle import EagleProposer
from specdec.proposers.eagle_lookup import EagleLookupProposer
from specdec.proposers.lookahead import LookaheadConfig, LookaheadProposer
from specdec.proposers.medusa import MedusaProposer
from specdec.proposers.prompt_lookup import PromptLookupProposer

__all__ = ["PLAIN", "PROPOSERS", "Proposer", "ProposerEnv", "ProposerFactory", "check_runs", "load_proposer",
           "method_names", "needs_trees", "register", "DraftModelProposer", "DraftRows", "EagleLookupProposer", "EagleProposer", "LookaheadConfig",
           "LookaheadProposer", "MedusaProposer", "PromptLookupProposer"]
