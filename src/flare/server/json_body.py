"""Bodies of the JSON POST routes are JSON whatever their Content-Type says (issue 20).

`curl -d '{...}'` without `-H 'Content-Type: application/json'` sends
`application/x-www-form-urlencoded`, and some clients send no type or `text/plain`.
FastAPI parses a body as JSON only when the type says JSON (or is missing), so such a
request would fail validation with a message about a missing object. Every POST route
under /v1 takes JSON and nothing else, so `JsonContentType` (a plain ASGI middleware)
marks their bodies `application/json`: a valid JSON body is served as if the header were
right, and one that is not JSON gets the route's usual 400 for invalid JSON.
"""

from __future__ import annotations

from typing import Any

JSON = b"application/json"


def _is_json(value: bytes) -> bool:
    kind = value.split(b";", 1)[0].strip().lower()
    return kind == JSON or (kind.startswith(b"application/") and kind.endswith(b"+json"))


class JsonContentType:
    """ASGI middleware: POST requests to `prefix` routes get `content-type:
    application/json` when they carry another type or none."""

    def __init__(self, app: Any, prefix: str = "/v1/") -> None:
        self.app, self.prefix = app, prefix

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if (scope["type"] == "http" and scope.get("method") == "POST"
                and scope.get("path", "").startswith(self.prefix)):
            headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
            given = [v for k, v in scope["headers"] if k == b"content-type"]
            if not (given and _is_json(given[0])):
                scope = {**scope, "headers": headers + [(b"content-type", JSON)]}
        await self.app(scope, receive, send)
