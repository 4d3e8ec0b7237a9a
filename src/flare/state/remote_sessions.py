"""Saved session names in Redis, shared by every replica of one package (the hash
`<tier prefix>:s`; `flare.state.sessions` keeps the names, this module shares them)."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from typing import TYPE_CHECKING

from flare.state.remote_link import _Down

if TYPE_CHECKING:
    from flare.state.remote_tier import RemoteTier

log = logging.getLogger(__name__)


class RemoteSessions:
    """Saved session names in Redis, shared by every replica of one package.

    One hash field per name holds the JSON of the session's tokens, saved positions, the
    save time and a BLAKE2b digest of them; it is written in one HSET after the records
    of its chain were written, so a reader sees a whole session or none, and of two
    replicas saving one name at once the later write wins whole. An entry that fails its
    digest (or is not ours) is ignored and counted.

    Args:
        tier: the remote tier (its client, prefix and fault handling are shared).
    """

    def __init__(self, tier: RemoteTier) -> None:
        self.tier = tier
        self.key = tier.prefix + ":s"
        self.rejected = 0

    def put(self, name: str, tokens: list[int], saved_tokens: int) -> bool:
        """Publish `name` -> (tokens, saved_tokens). False when Redis is down."""
        body = {"namespace": self.tier.namespace, "tokens": [int(t) for t in tokens],
                "saved_tokens": int(saved_tokens), "saved_at": time.time()}
        body["digest"] = _session_digest(body)
        data = json.dumps(body, separators=(",", ":"))
        try:
            self.tier._call(lambda: self.tier._client.hset(self.key, name, data))
        except _Down:
            return False
        return True

    def get(self, name: str) -> tuple[list[int], int, float] | None:
        """(tokens, saved_tokens, saved_at) of `name`, or None: absent, down or damaged."""
        try:
            raw = self.tier._call(lambda: self.tier._client.hget(self.key, name))
        except _Down:
            return None
        if raw is None:
            return None
        try:
            body = json.loads(raw)
            ok = (body["namespace"] == self.tier.namespace
                  and body["digest"] == _session_digest(body))
            tokens = [int(t) for t in body["tokens"]]
            saved = int(body["saved_tokens"])
            at = float(body["saved_at"])
        except (ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            self.rejected += 1
            log.warning("remote session %r ignored: damaged or not this package's", name)
            return None
        return tokens, saved, at

    def delete(self, name: str) -> None:
        """Forget `name` (nothing if absent or down)."""
        try:
            self.tier._call(lambda: self.tier._client.hdel(self.key, name))
        except _Down:
            pass


def _session_digest(body: dict) -> str:
    core = json.dumps([body["namespace"], body["tokens"], body["saved_tokens"],
                       body["saved_at"]], separators=(",", ":"))
    return hashlib.blake2b(core.encode(), digest_size=16).hexdigest()
