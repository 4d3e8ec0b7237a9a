"""The interactive loop of `flare chat`: prompt_toolkit reads the input (line editing,
history, multi-line), rich renders the streamed answer as Markdown.

Keys (`flare.chat.prompt_input`): Enter sends, Alt+Enter starts a new line. Ctrl+C while
an answer streams stops it (the connection is closed, so the server aborts the request and
frees its pages) and keeps what came; Ctrl+C at the prompt clears the line, a second one in
a row exits, as does Ctrl+D or /exit. Answers are shown by `flare.chat.answer_view`.

Each turn sends the whole conversation naming its session (`"session": NAME`), so the
server pins the conversation's state; the messages are kept by `ConversationStore`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from prompt_toolkit import PromptSession
from prompt_toolkit.history import FileHistory, InMemoryHistory
from rich.console import Console
from rich.markdown import Markdown
from rich.markup import escape
from rich.table import Table

from flare.chat.answer_view import format_stats, show_answer
from flare.chat.client import ChatError, ChatStream, FlareClient, TurnStats
from flare.chat.prompt_input import ctrl_c_interrupts, key_bindings, unquote
from flare.chat.store import Conversation, ConversationStore, StoreError, check_name

HELP = [
    ("/new [NAME]", "start a new conversation (a new session)"),
    ("/sessions", "list the conversations kept here, with the server's state of each"),
    ("/switch NAME", "continue another conversation"),
    ("/fork NAME", "branch this conversation into NAME (pages shared) and continue there"),
    ("/save", "write this session's state to the server's disk tier (survives a restart)"),
    ("/stats", ("the last answer's figures: time to first token, tokens/s, cached tokens, "
                "where the reused state came from")),
    ("/system [TEXT]", "show or set the system prompt of this conversation"),
    ("/help", "this list"),
    ("/exit", "leave (also Ctrl+D, or Ctrl+C twice at the prompt)"),
]


@dataclass(frozen=True)
class ChatOptions:
    """Request fields of every turn (None: the server's default) and local settings.

    Attributes:
        max_tokens: most tokens of one answer.
        temperature: sampling temperature (0: greedy).
        ignore_eos: keep generating past end-of-sequence until max_tokens.
        markdown: render answers as Markdown (False: plain text as it arrives).
        save_on_exit: save the session to the disk tier when leaving.
    """

    max_tokens: int | None = None
    temperature: float | None = None
    ignore_eos: bool = False
    markdown: bool = True
    save_on_exit: bool = True


class ChatApp:
    """One terminal chat over `client` with conversations in `store`.

    Args:
        client: the server.
        model: the served model id requests name.
        store: where the conversations' messages are kept.
        conversation: the one to start with (new or loaded).
        options: request fields and settings.
        console: where output goes (a rich Console on the terminal).
        history_file: prompt_toolkit's input history (None: in memory).
    """

    def __init__(self, client: FlareClient, model: str, store: ConversationStore,
                 conversation: Conversation, options: ChatOptions, console: Console,
                 history_file: Path | None = None) -> None:
        self.client, self.model, self.store = client, model, store
        self.conv, self.options, self.console = conversation, options, console
        self.last_stats: TurnStats | None = None
        self.dirty: set[str] = set()  # sessions answered since their last save
        self.history_file = history_file
        self.commands: dict[str, Callable[[str], bool | None]] = {
            "/new": self.cmd_new, "/sessions": self.cmd_sessions, "/switch": self.cmd_switch,
            "/fork": self.cmd_fork, "/save": self.cmd_save, "/stats": self.cmd_stats,
            "/system": self.cmd_system, "/help": self.cmd_help, "/exit": self.cmd_exit,
            "/quit": self.cmd_exit, "/bye": self.cmd_exit,
        }

    # -- output helpers -------------------------------------------------------------
    def note(self, text: str) -> None:
        self.console.print(f"[dim]{escape(text)}[/dim]", highlight=False)

    def error(self, text: str) -> None:
        self.console.print(f"[red]{escape(text)}[/red]", highlight=False)

    def describe(self, resumed: bool) -> None:
        """One line on the current conversation (and its last answer when resumed)."""
        c = self.conv
        if not resumed or not c.messages:
            self.note(f"session {c.name}: new conversation")
            return
        held = ""
        try:
            info = self.client.session(c.name)
        except ChatError:
            info = None
        if info is not None:
            held = (f"; the server holds {info['tokens']} of its tokens, "
                    f"{info['saved_tokens']} saved to disk")
        self.note(f"session {c.name}: {len(c.messages)} messages{held}")
        last = next((m for m in reversed(c.messages) if m["role"] == "assistant"), None)
        if last is not None:
            self.render_final(last["content"])

    def render_final(self, text: str) -> None:
        self.console.print(Markdown(text) if self.options.markdown else text)

    # -- the loop -------------------------------------------------------------------
    def run(self, resumed: bool) -> int:
        """Read and answer until the user leaves. Returns the exit status (0)."""
        with ctrl_c_interrupts():
            return self._run(resumed)

    def _run(self, resumed: bool) -> int:
        self.console.print(f"[bold]flare chat[/bold] · {escape(self.model)} at "
                           f"{escape(self.client.url)}", highlight=False)
        self.note("/help lists the commands · Enter sends, Alt+Enter (Esc Enter) starts a "
                  "new line · Ctrl+C stops an answer · Ctrl+D leaves")
        self.describe(resumed)
        history = FileHistory(str(self.history_file)) if self.history_file \
            else InMemoryHistory()
        prompt = PromptSession(history=history, key_bindings=key_bindings(),
                               multiline=True, prompt_continuation="... ")
        interrupted = False
        try:  # a Ctrl+C between two prompts leaves, as a second one at the prompt does
            while True:
                try:
                    text = prompt.prompt(f"{self.conv.name}> ")
                except KeyboardInterrupt:
                    if interrupted:
                        break
                    interrupted = True
                    try:
                        self.note("(Ctrl+C again or Ctrl+D to leave)")
                    except KeyboardInterrupt:  # the second one came before the next prompt
                        break
                    continue
                except EOFError:
                    break
                interrupted = False
                text = unquote(text)
                if not text.strip():
                    continue
                if text.startswith("/"):
                    word, _, rest = text.partition(" ")
                    handler = self.commands.get(word.strip())
                    if handler is None:
                        self.error(f"unknown command {word}; /help lists them")
                        continue
                    try:
                        if handler(rest.strip()) is False:
                            break
                    except KeyboardInterrupt:  # Ctrl+C during a command cancels the command
                        self.note("[command interrupted]")
                    continue
                try:
                    self.turn(text)
                except KeyboardInterrupt:  # outside the stream (sending, storing): stop it
                    if self.conv.messages[-1:] == [{"role": "user", "content": text}]:
                        self.conv.messages.pop()  # no answer: the question is not kept
                    self.note("[stopped]")
        except KeyboardInterrupt:
            pass
        self.leave()
        return 0

    def turn(self, text: str) -> None:
        """Send one user message, stream the answer, keep both."""
        conv = self.conv
        conv.messages.append({"role": "user", "content": text})
        stream = self._stream(conv)
        stopped = False
        try:
            answer, stopped = self._show(stream)
        except ChatError as exc:
            if exc.code == "session_budget_exceeded":  # too long to pin: answer unpinned
                self.note(f"{exc}; answering without pinning the session")
                stream = self._stream(conv, pinned=False)
                try:
                    answer, stopped = self._show(stream)
                except ChatError as again:
                    return self._failed(again)
            else:
                return self._failed(exc)
        finally:
            stream.close()
        self.last_stats = stream.stats
        if stopped:
            self.note("[stopped]")
        if answer or not stopped:
            conv.messages.append({"role": "assistant", "content": answer})
        else:
            conv.messages.pop()  # nothing came back: the question is not part of it
        self.dirty.add(conv.name)
        self._store(conv)

    def _failed(self, exc: ChatError) -> None:
        self.conv.messages.pop()
        self.error(str(exc))

    def _stream(self, conv: Conversation, pinned: bool = True) -> ChatStream:
        o = self.options
        return self.client.stream_chat(
            self.model, conv.request_messages(), conv.name if pinned else None,
            max_tokens=o.max_tokens, temperature=o.temperature,
            ignore_eos=True if o.ignore_eos else None)

    def _show(self, stream: ChatStream) -> tuple[str, bool]:
        """Print the answer as it streams. Returns (text, stopped by Ctrl+C)."""
        return show_answer(stream, self.console, self.options.markdown)

    def _store(self, conv: Conversation) -> None:
        try:
            self.store.save(conv)
        except OSError as exc:
            self.error(f"the conversation could not be written to {self.store.folder}: {exc}")

    def leave(self) -> None:
        """Save the answered sessions to the disk tier (unless turned off)."""
        if not self.options.save_on_exit:
            return
        for name in sorted(self.dirty):
            self._save(name, quiet_no_tier=True)

    def _save(self, name: str, quiet_no_tier: bool = False) -> bool:
        try:
            with self.console.status(f"saving {name} to the disk tier"):
                r = self.client.save(name)
        except ChatError as exc:
            if exc.status == 404:
                self.note(f"{name}: the server holds no state for it yet (nothing answered)")
            elif exc.code == "no_disk_tier" and quiet_no_tier:
                self.note(f"{name} not saved: the server has no disk tier (--state-dir)")
            else:
                self.error(f"{name} not saved: {exc}")
            return False
        self.dirty.discard(name)
        self.note(f"saved {name}: {r.get('saved_tokens')} tokens on the server's disk tier")
        return True

    # -- commands (each returns False to leave) -------------------------------------
    def _switch_to(self, conv: Conversation, resumed: bool) -> None:
        self.conv = conv
        self.store.set_last(conv.name)
        self.last_stats = None
        self.describe(resumed)

    def cmd_new(self, arg: str) -> None:
        try:
            name = check_name(arg) if arg else self.store.new_name()
        except StoreError as exc:
            return self.error(str(exc))
        if self.store.exists(name) or name == self.conv.name:
            return self.error(f"{name} exists already: /switch {name} continues it")
        conv = Conversation(name=name, system=self.conv.system)
        self._store(conv)
        self._switch_to(conv, resumed=False)

    def cmd_switch(self, arg: str) -> None:
        if not arg:
            return self.error("/switch NAME: which one? /sessions lists them")
        if arg == self.conv.name:
            return self.note(f"already on {arg}")
        try:
            conv = self.store.load(check_name(arg))
        except StoreError as exc:
            return self.error(f"{exc}; /sessions lists them")
        self._switch_to(conv, resumed=True)

    def cmd_fork(self, arg: str) -> None:
        try:
            new = check_name(arg)
        except StoreError as exc:
            return self.error(f"/fork NAME: {exc}")
        if self.store.exists(new) or new == self.conv.name:
            return self.error(f"{new} exists already")
        old = self.conv
        shared = ""
        if old.messages:
            try:
                r = self.client.fork(old.name, new)
                shared = f"; the server shares its {r.get('tokens')} tokens' pages"
            except ChatError as exc:
                if exc.status == 404:  # not held by name (e.g. a restart): found by tokens
                    shared = "; the server will find its state by its tokens"
                elif exc.code == "session_exists":
                    shared = f"; the server's older session {new} is replaced at the next turn"
                else:
                    return self.error(f"fork failed: {exc}")
        conv = Conversation(name=new, system=old.system,
                            messages=[dict(m) for m in old.messages], forked_from=old.name)
        self._store(conv)
        self.note(f"forked {old.name} into {new}{shared}; now on {new} "
                  f"(/switch {old.name} goes back)")
        self.conv = conv
        self.last_stats = None

    def cmd_sessions(self, arg: str) -> None:
        names = self.store.names()
        if self.conv.name not in names:
            names.insert(0, self.conv.name)
        table = Table(box=None, pad_edge=False, show_edge=False)
        for col in ("", "session", "messages", "server tokens", "saved to disk", "forked from"):
            table.add_column(col)
        for name in names[:50]:
            conv = self.conv if name == self.conv.name else self._load_quiet(name)
            if conv is None:
                continue
            try:
                info = self.client.session(name)
            except ChatError:
                info = None
            table.add_row("*" if name == self.conv.name else "", name, str(len(conv.messages)),
                          str(info["tokens"]) if info else "-",
                          str(info["saved_tokens"]) if info else "-", conv.forked_from or "")
        self.console.print(table)

    def _load_quiet(self, name: str) -> Conversation | None:
        try:
            return self.store.load(name)
        except StoreError:
            return None

    def cmd_save(self, arg: str) -> None:
        self._store(self.conv)
        self._save(self.conv.name)

    def cmd_stats(self, arg: str) -> None:
        if self.last_stats is None:
            return self.note("no answer yet in this conversation")
        for line in format_stats(self.last_stats):
            self.console.print(line, highlight=False)

    def cmd_system(self, arg: str) -> None:
        if not arg:
            return self.note(f"system prompt: {self.conv.system!r}" if self.conv.system
                             else "no system prompt (the model's default)")
        self.conv.system = arg
        self._store(self.conv)
        later = " (it comes first: the next answer recomputes the conversation)" \
            if self.conv.messages else ""
        self.note(f"system prompt set{later}")

    def cmd_help(self, arg: str) -> None:
        for cmd, what in HELP:
            self.console.print(f"  [bold]{escape(cmd):<15}[/bold] {escape(what)}",
                               highlight=False)

    def cmd_exit(self, arg: str) -> bool:
        return False

