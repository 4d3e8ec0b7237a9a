"""Stored Responses API records in Redis, shared by every replica of one package.

A replica keeps its stored responses in memory (and, with a disk tier, in files); behind a
gateway the next turn's `previous_response_id` may land on another replica, which then
finds the record here. The record is what continuing needs (the conversation as chat
messages, its exact text and token ids); the state itself is found by those tokens in the
remote tier, like any other prefix (docs/scale-out.md, "Responses through the gateway").

One key per response, `<tier prefix>:resp:<id>`, holds the record's JSON with the package
id and a BLAKE2b digest; it is written with one SET and expires after `ttl_s` (Redis
bounds the count by time, the replicas' local stores by number). A delete leaves a
tombstone, so a replica that kept its own copy (it served a turn) drops it when asked for
it. A record that fails its digest or names another package is ignored and counted. Redis down: every call answers
"absent" (the tier's fault handling), so a continuation elsewhere is a 404, never a 5xx.
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import TYPE_CHECKING, Any

# The link's "down" signal (and, below, the tier's call wrapper): one fault policy for
# every Redis user, as flare.state.remote_sessions.
from flare.state.remote_link import _Down

if TYPE_CHECKING:
    from flare.state.remote_tier import RemoteTier

log = logging.getLogger(__name__)

RESPONSE_TTL_S = 24 * 3600  # how long another replica can continue a stored response
FOUND, DELETED, ABSENT = "found", "deleted", "absent"


class RemoteResponses:
    """Stored response records by id in the remote tier's Redis.

    Args:
        tier: the remote tier (its client, key prefix, namespace and fault handling).
        ttl_s: seconds a record stays after its last write.
    """

    def __init__(self, tier: RemoteTier, ttl_s: int = RESPONSE_TTL_S) -> None:
        self.tier = tier
        self.ttl_s = int(ttl_s)
        self.rejected = 0

    def _key(self, response_id: str) -> str:
        return f"{self.tier.prefix}:resp:{response_id}"

    def put(self, response_id: str, record: dict[str, Any]) -> bool:
        """Publish `record` (a JSON-able dict with its "id") under `response_id`. False
        when Redis is down (the record then stays on this replica only)."""
        return self._write(response_id, record)

    def _write(self, response_id: str, record: dict[str, Any] | None) -> bool:
        body = {"namespace": self.tier.namespace, "record": record}
        body["digest"] = _digest(body)
        data = json.dumps(body, ensure_ascii=False, separators=(",", ":"))
        try:
            self.tier._call(lambda: self.tier._client.set(self._key(response_id), data,
                                                           ex=self.ttl_s))
        except _Down:
            return False
        return True

    def get(self, response_id: str) -> tuple[str, dict[str, Any] | None]:
        """("found", record), ("deleted", None) when a replica deleted it, or ("absent",
        None): never written, expired, Redis down, or damaged (counted)."""
        try:
            raw = self.tier._call(lambda: self.tier._client.get(self._key(response_id)))
        except _Down:
            return ABSENT, None
        if raw is None:
            return ABSENT, None
        try:
            body = json.loads(raw)
            ok = (body["namespace"] == self.tier.namespace and body["digest"] == _digest(body)
                  and (body["record"] is None or body["record"].get("id") == response_id))
        except (ValueError, KeyError, TypeError, AttributeError):
            ok = False
        if not ok:
            self.rejected += 1
            log.warning("remote response %r ignored: damaged or not this package's",
                        response_id)
            return ABSENT, None
        return (DELETED, None) if body["record"] is None else (FOUND, body["record"])

    def delete(self, response_id: str) -> bool:
        """Forget `response_id` on every replica: its record becomes a tombstone (for
        `ttl_s`) that makes a replica holding its own copy drop it too. False when there
        was no record (or Redis is down)."""
        if self.get(response_id)[0] != FOUND:
            return False
        return self._write(response_id, None)

def _digest(body: dict[str, Any]) -> str:
    core = json.dumps([body["namespace"], body["record"]], ensure_ascii=False,
                      separators=(",", ":"), sort_keys=True)
    return hashlib.blake2b(core.encode(), digest_size=16).hexdigest()
