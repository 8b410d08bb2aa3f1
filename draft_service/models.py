"""Which draft model the service runs when none is given.

INTERIM: no trained default draft ships with the package yet (another issue trains it). Until
then the service uses an untrained early-exit copy of the embedded default target (its first
4 decoder layers plus its embeddings, final norm and output layer), which agrees with the
target on roughly 4-30% of tokens. Replace `default_draft` alone when the trained draft lands.
"""

from __future__ import annotations

import logging

from specdec.lm import CausalLM

log = logging.getLogger("draft_service")
INTERIM_EARLY_EXIT_LAYERS = 4


def default_draft() -> CausalLM:
    from specdec.models import early_exit_copy, load_model

    target = load_model()
    log.warning("no --draft given: using the INTERIM draft early_exit_copy(%s, %d) (untrained; a trained default "
                "draft is not shipped yet)", target.lm.name, INTERIM_EARLY_EXIT_LAYERS)
    return early_exit_copy(target.lm, INTERIM_EARLY_EXIT_LAYERS)


def load_draft(path: str | None) -> CausalLM:
    if path is None:
        return default_draft()
    from specdec.models import load_model

    return load_model(path).lm
