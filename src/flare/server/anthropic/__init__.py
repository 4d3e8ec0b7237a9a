"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`) over
Flare's shared generation core: `routes.messages_router` (included by `create_app`),
`protocol` (requests and their checks), `chat_prompt` (a request as a chat), `events` (the
message and its SSE events), `errors` (Anthropic's error shape). docs/agents.md says how
to point Claude Code and the `anthropic` SDK at Flare.

Nothing is imported here: `flare.server.guard` imports `errors` alone.
"""
