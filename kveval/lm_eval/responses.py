"""Answers computed for other policies in one shared prefill, held until their own lm-eval runs ask
(:meth:`kveval.lm_eval.model.KVEvalLM.share_prefill`)."""

from __future__ import annotations

import hashlib
import json


class ResponseStore:
    """Responses one lm-eval call computed for the *other* policies of a shared prefill, until their runs ask.

    Keyed by ``(run spec key, call key)``, where the call key fingerprints the
    request kind and every request of one ``_loglikelihood_tokens`` or
    ``generate_until`` call (lm-eval asks each policy's run the same calls for
    the same task). A value is the call's answers plus the cache measurements
    the policy's run records, in the order it records them; it is removed when
    read, so the store holds only what is still to be served. Share one store
    only among :class:`KVEvalLM` instances built with the same model arguments
    but the policy (the answers are computed with the first one's settings).
    """

    def __init__(self):
        self._served: dict[tuple[str, str], tuple[list, list]] = {}

    def put(self, spec_key: str, call_key: str, answers: list, records: list) -> None:
        self._served[(spec_key, call_key)] = (answers, records)

    def take(self, spec_key: str, call_key: str) -> tuple[list, list] | None:
        return self._served.pop((spec_key, call_key), None)

    def __len__(self) -> int:
        return len(self._served)


def call_key(kind: str, args: list) -> str:
    """A fingerprint of one request-level call: its kind and every request's arguments, in order."""
    return hashlib.sha256(json.dumps([kind, args], default=str).encode()).hexdigest()


__all__ = ["ResponseStore", "call_key"]
