"""OpenAI's Chat Completions and Completions API (`POST /v1/chat/completions`,
`POST /v1/completions`, `GET /v1/models`) over Flare's shared generation core:
`routes.openai_router` (included by `create_app`), `messages` (conversation messages and
tools, which the generation core and the other surfaces' conversions also speak),
`protocol` (the request bodies) and `replies` (the response bodies).

Nothing is imported here, so that importing `messages` does not pull in the routes.
"""
