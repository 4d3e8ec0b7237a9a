"""How `flare chat` shows an answer: streamed as Markdown (rich) or as plain text, and
the /stats lines of a turn."""

from __future__ import annotations

import time

from rich.console import Console
from rich.live import Live
from rich.markdown import Markdown

from flare.chat.client import ChatStream, TurnStats

REFRESH_S = 0.08  # at most this often the streamed Markdown is re-rendered


def show_answer(stream: ChatStream, console: Console, markdown: bool) -> tuple[str, bool]:
    """Print the answer as it streams: Markdown re-rendered live on a terminal, plain text
    as it arrives otherwise (or without `markdown`).

    Returns:
        (the text that came, whether Ctrl+C stopped it).

    Raises:
        ChatError: the server refused or the stream failed.
    """
    text = ""
    if not markdown or not console.is_terminal:
        try:
            for delta in stream:
                text += delta
                console.out(delta, end="", highlight=False)
        except KeyboardInterrupt:
            console.out("")
            return text, True
        console.out("")
        return text, False
    shown = 0.0
    with Live(Markdown(""), console=console, auto_refresh=False,
              vertical_overflow="visible") as live:
        try:
            for delta in stream:
                text += delta
                now = time.monotonic()
                if now - shown >= REFRESH_S:
                    live.update(Markdown(text), refresh=True)
                    shown = now
        except KeyboardInterrupt:
            live.update(Markdown(text), refresh=True)
            return text, True
        live.update(Markdown(text), refresh=True)
    return text, False


def format_stats(s: TurnStats) -> list[str]:
    """/stats lines for one turn (server figures labelled with their clock)."""
    def sec(v: float | None) -> str:
        return f"{v:.3f} s" if v is not None else "not reported"

    lines = [(f"time to first token  {sec(s.ttft_s)} (server clock), "
              f"{sec(s.client_ttft_s)} (as this client saw it)")]
    rate = (f"{s.decode_tokens_per_s:.1f} tokens/s (server clock, tokens after the first)"
            if s.decode_tokens_per_s is not None else "not reported")
    lines.append(f"decode               {rate}")
    if s.prompt_tokens is None:
        lines.append("prompt               not reported (the answer was stopped before "
                     "the server sent its usage)")
    else:
        where = f"from the {s.tier}" if s.tier else "none reused"
        lines.append(f"prompt               {s.prompt_tokens} tokens, {s.cached_tokens or 0} "
                     f"cached ({where}; reuse {s.outcome or 'not reported'})")
    done = s.completion_tokens if s.completion_tokens is not None else "?"
    lines.append(f"answer               {done} tokens, finish: {s.finish_reason}")
    return lines
