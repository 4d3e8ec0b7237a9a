"""`flare chat`: an interactive terminal chat with a Flare server.

- `client`: HTTP/SSE client of the chat and session routes (httpx).
- `store`: the conversations' messages, one JSON file each, named like their session.
- `flare.serve_child.ChildServer` (outside this package) starts the `flare serve` child of
  `flare chat PKG` / `--embedded`.
- `repl`: the loop and its slash commands; `prompt_input` its keys (prompt_toolkit) and
  Ctrl+C, `answer_view` the streamed answer (rich Markdown) and /stats.
- `cli`: the subcommand's options (`flare.cli` only registers it).

Imports nothing from the server or the engine (only the session-name rule of
`flare.state.sessions`): it talks HTTP.
"""
