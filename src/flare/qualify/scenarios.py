"""Scenarios: named groups of requests, run one after another (one request at a time).

Every request the harness attempts is listed under its scenario before it is sent and
becomes exactly one observation, whatever happens to it (ok, failed, cancelled).

Groups: a scenario's measured requests are in the group named like the scenario; requests
that only set a scenario up (the first turn before a continuation, the stream that gets
cancelled, the shared history of a branch) are in `<scenario>.setup`.

- `warmup`: one short request, so first-call costs do not land in a measured group.
- `ttft-512`: cold requests whose prompts are exactly 512 tokens (token ids sent to
  /v1/completions when the package's tokenizer is known; text of about that size
  otherwise), each starting with a unique nonce so that nothing can be reused.
- `miss`: single-turn chats, each with a unique system prompt (nothing to reuse).
- `device-hit`: a chat (setup), then its continuation with the model's reply and a new
  user message (the measured request: its prefix was just computed on the device).
- `cancel`: a stream closed by the client after its first token (setup, cancelled), then
  the session continued with the partial reply (measured).
- `branch`: a history (setup), then two different continuations of it (measured).
- `agent-session`: corpus sessions replayed turn by turn: one request per user message
  (tool results included), the prompt being the corpus's messages up to it (the corpus's
  own assistant messages, not the model's replies, so every run sends the same prompts).
- `agent-session-cold`: the same turns, each with a unique nonce at the start of the system
  prompt, so nothing can be reused: the "without reuse" baseline.
- `host-restore`: conversations over a long first message; before the last turn the
  harness moves every cached state out of the device pools to the host tier
  (`POST /v1/state/offload {"to": "host"}`), then sends it (measured): its prefix comes
  back from host memory, or is recomputed, as the server's reuse record says.
- `restart-restore`: the same kind of conversations, all but their last turn; then
  `POST /v1/state/offload {"to": "disk"}`, the server is restarted on the same state
  folder, one short request takes the new process's first-call costs (setup), and each
  conversation is resent with its new turn (measured): restored from disk or recomputed.
  Needs a server the harness started (`restart`); skipped otherwise.

Around each measured restore request the harness snapshots `GET /debug/state`
(`before:<request id>`, `after:<request id>`): the tier counters' change between the two
(`tier_restores_host_total`, `tier_restores_disk_total`, `tier_restored_tokens_total`) says
which tier the state came from. The snapshot right after a restart is labelled
`restarted:restart-restore`: the new process's counters start again there
(`flare.evidence.checks.server_lifetimes`).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from flare.evidence.checks import RESTARTED
from flare.qualify.client import Client
from flare.qualify.workload import (
    FILLER,
    FOLLOW_UPS,
    QUESTIONS,
    RESTORE_ASK,
    RESTORE_FOLLOW_UPS,
    SYSTEM,
    Settings,
)


@dataclass
class ScenarioRecord:
    name: str
    status: str = "ran"
    reason: str | None = None
    request_ids: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status, "reason": self.reason,
                "request_ids": list(self.request_ids)}


class Run:
    """State of one qualification run: observations, scenario records, server snapshots.

    Args:
        client: the HTTP client.
        settings: what to run.
        tokenizer: the package's tokenizer (exact 512-token prompts, token counts), or None.
        corpus: the loaded agent-session corpus, or None.
        log: progress lines (stderr).
        restart: stops the server and starts it again on the same address and state
            folder (returns once it answers), or None when the harness cannot (a server
            given by --url): then `restart-restore` is skipped.
    """

    def __init__(self, client: Client, settings: Settings, tokenizer: Any = None,
                 corpus: dict[str, Any] | None = None,
                 log: Callable[[str], None] = lambda s: None,
                 restart: Callable[[], None] | None = None) -> None:
        self.client = client
        self.restart = restart
        self.settings = settings
        self.tokenizer = tokenizer
        self.corpus = corpus
        self.log = log
        self.nonce = uuid.uuid4().hex[:12]
        self.observations: list[dict[str, Any]] = []
        self.scenarios: list[ScenarioRecord] = []
        self.snapshots: list[dict[str, Any]] = []
        self._current: ScenarioRecord | None = None
        self._first_tokens: set[int] = set()

    # ------------------------------------------------------------------ bookkeeping

    def wait_idle(self) -> tuple[dict[str, Any], bool] | None:
        """Wait (bounded) until the server is idle: (GET /debug/state's numbers, idle), or
        None when the route does not answer."""
        deadline = time.monotonic() + self.settings.idle_timeout_s
        while True:
            try:
                raw = self.client.get_json("/debug/state")
            except Exception:  # a server without the route: no snapshot, nothing invented
                return None
            state = {k: v for k, v in raw.items()
                     if isinstance(v, (int, float)) and not isinstance(v, bool)}
            idle = not state.get("num_running", 0) and not state.get("num_waiting", 0)
            if idle or time.monotonic() > deadline:
                return state, idle
            time.sleep(0.05)

    def snapshot(self, label: str) -> None:
        """Wait (bounded) until the server is idle, then record GET /debug/state."""
        got = self.wait_idle()
        if got is None:
            return
        state, idle = got
        self.snapshots.append({"label": label, "client_ns": time.monotonic_ns(), "idle": idle,
                               "state": state})

    def scenario(self, name: str, body: Callable[[], None]) -> None:
        rec = ScenarioRecord(name)
        self.scenarios.append(rec)
        self._current = rec
        started = time.monotonic()
        try:
            body()
        except Exception as exc:  # keep what was observed; say why the rest is missing
            rec.status = "aborted"
            rec.reason = f"{type(exc).__name__}: {exc}"[:500]
        finally:
            self._current = None
        self.snapshot(f"after:{name}")
        statuses = [o["status"] for o in self.observations[-len(rec.request_ids):]] \
            if rec.request_ids else []
        self.log(f"scenario {name}: {len(rec.request_ids)} requests "
                 f"({statuses.count('ok')} ok) in {time.monotonic() - started:.1f} s"
                 + (f"; {rec.status}: {rec.reason}" if rec.status != "ran" else ""))

    def skip(self, name: str, reason: str) -> None:
        self.scenarios.append(ScenarioRecord(name, "skipped", reason))

    def next_request_id(self) -> str:
        """The id the next `send` of the current scenario will get."""
        rec = self._current
        assert rec is not None, "outside a scenario"
        return f"{rec.name}/{len(rec.request_ids):03d}"

    def offload(self, to: str) -> dict[str, Any]:
        """`POST /v1/state/offload {"to": to}` once the server is idle: every cached state
        no request uses leaves the device pools (to "host" memory, or on to "disk").

        Raises:
            RouteError: the server refused (no such tier: 503 no_host_tier / no_disk_tier).
        """
        self.wait_idle()
        started = time.monotonic()
        answer = self.client.post_json("/v1/state/offload", {"to": to})
        self.log(f"offload to {to}: {answer.get('pages_released')} pages released, "
                 f"{answer.get('records_written')} records written "
                 f"({time.monotonic() - started:.2f} s)")
        return answer

    def send(self, group: str, *, messages: list[dict[str, Any]] | None = None,
             prompt: str | list[int] | None = None, max_tokens: int | None = None,
             session: str | None = None, turn: int | None = None, cancel: bool = False,
             prompt_tokens_target: int | None = None) -> tuple[dict[str, Any], str]:
        rec = self._current
        assert rec is not None, "send() outside a scenario"
        rid = self.next_request_id()
        rec.request_ids.append(rid)  # listed as sent before it is sent
        n = max_tokens or self.settings.max_tokens
        if messages is not None:
            fields, text = self.client.chat(messages, n, cancel_after_first_token=cancel)
        else:
            fields, text = self.client.completion(prompt, n, cancel_after_first_token=cancel)
        fields["request"]["prompt_tokens_target"] = prompt_tokens_target
        obs = {"seq": len(self.observations), "request_id": rid, "scenario": rec.name,
               "group": group, "session": session, "turn": turn, **fields}
        self.observations.append(obs)
        return obs, text

    # ------------------------------------------------------------------ prompts

    def system(self, tag: str) -> dict[str, str]:
        """A system message that starts with a unique id (then `tag`): after the chat
        template's fixed opening, nothing is shared with any other request."""
        return {"role": "system", "content": f"[{uuid.uuid4().hex[:16]} {tag}] {SYSTEM}"}

    def ttft_prompt(self, i: int) -> tuple[str | list[int], int | None]:
        """(prompt, exact token count or None) of the i-th ttft-512 request: token ids whose
        first token no earlier ttft-512 prompt of this run had (so no prefix can match),
        or, without a tokenizer, text of about that many tokens starting with a random id."""
        n = self.settings.ttft_prompt_tokens
        while True:
            head = f"{uuid.uuid4().hex[:8]} request {i}: "
            if self.tokenizer is None:
                return (head + FILLER * (n * 4 // len(FILLER) + 1))[: n * 4], None
            text = head + FILLER * (n // 60 + 2)
            ids = list(self.tokenizer.encode(text, add_special_tokens=False))
            while len(ids) < n:
                text += FILLER
                ids = list(self.tokenizer.encode(text, add_special_tokens=False))
            if ids[0] not in self._first_tokens:
                self._first_tokens.add(ids[0])
                return ids[:n], n

    # ------------------------------------------------------------------ scenarios

    def run_all(self) -> None:
        s = self.settings
        self.snapshot("start")
        self.scenario("warmup", lambda: [
            self.send("warmup", messages=[self.system(f"warmup-{i}"),
                                          {"role": "user", "content": "Say hello."}])
            for i in range(s.warmup)])
        self.scenario("ttft-512", self._ttft)
        self.scenario("miss", self._miss)
        self.scenario("device-hit", self._device_hit)
        self.scenario("cancel", self._cancel)
        self.scenario("branch", self._branch)
        if self.corpus is None:
            self.skip("agent-session", "no corpus given")
        else:
            self.scenario("agent-session", lambda: self._agent(cold=False))
            if s.cold:
                self.scenario("agent-session-cold", lambda: self._agent(cold=True))
            else:
                self.skip("agent-session-cold", "disabled (--no-cold)")
        if s.host_restore:
            self.scenario("host-restore", self._host_restore)
        else:
            self.skip("host-restore", "disabled (no conversations)")
        # last: it restarts the server
        if self.restart is None:
            self.skip("restart-restore", "the server was not started by the harness (--url): "
                                         "it cannot be restarted")
        elif not s.restart_restore:
            self.skip("restart-restore", "disabled (--no-restart)")
        else:
            self.scenario("restart-restore", self._restart_restore)
        self.snapshot("end")

    def _ttft(self) -> None:
        for i in range(self.settings.ttft_samples):
            prompt, exact = self.ttft_prompt(i)
            self.send("ttft-512", prompt=prompt,
                      prompt_tokens_target=exact or self.settings.ttft_prompt_tokens)

    def _miss(self) -> None:
        for i in range(self.settings.miss):
            self.send("miss", messages=[self.system(f"miss-{i}"),
                                        {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}])

    def _follow_up(self, scenario: str, sid: str, question: str, follow_up: str,
                   **setup: Any) -> None:
        """Turn 0 (`<scenario>.setup`, with `setup`'s extra send options) asks `question`
        in session `sid`; turn 1 (`scenario`, the measured one) asks `follow_up` after
        the reply, whole or cut."""
        history = [self.system(sid), {"role": "user", "content": question}]
        _, reply = self.send(f"{scenario}.setup", messages=history, session=sid, turn=0,
                             **setup)
        history += [{"role": "assistant", "content": reply},
                    {"role": "user", "content": follow_up}]
        self.send(scenario, messages=history, session=sid, turn=1)

    def _device_hit(self) -> None:
        for i in range(self.settings.device_hit):
            self._follow_up("device-hit", f"hit-{i}", QUESTIONS[i % len(QUESTIONS)],
                            FOLLOW_UPS[i % len(FOLLOW_UPS)])

    def _cancel(self) -> None:
        for i in range(self.settings.cancel):
            self._follow_up("cancel", f"cancel-{i}",
                            "Explain in detail how a hash map works, with an example in Python.",
                            "Stop there. Summarize it in one line.",
                            cancel=True, max_tokens=self.settings.cancel_max_tokens)

    def _branch(self) -> None:
        for i in range(self.settings.branch):
            sid = f"branch-{i}"
            history = [self.system(sid), {"role": "user", "content":
                       "Write a Python function that merges two sorted lists."}]
            _, reply = self.send("branch.setup", messages=history, session=sid, turn=0)
            history.append({"role": "assistant", "content": reply})
            for j, ask in enumerate(("Now write pytest tests for it.",
                                     "Now make it work for any number of lists.")):
                self.send("branch", messages=history + [{"role": "user", "content": ask}],
                          session=f"{sid}/{'ab'[j]}", turn=1)

    def _agent(self, cold: bool) -> None:
        corpus = self.corpus
        assert corpus is not None
        group = "agent-session-cold" if cold else "agent-session"
        stopped = []
        for session in corpus["sessions"][: self.settings.sessions]:
            messages = session["messages"]
            user_idx = [i for i, m in enumerate(messages) if m["role"] == "user"]
            for turn, idx in enumerate(user_idx[: self.settings.max_turns]):
                tag = f"{uuid.uuid4().hex[:12]}" if cold else f"run {self.nonce}"
                system = {"role": "system", "content": f"[{tag}] {corpus['system']}"}
                obs, _ = self.send(group, messages=[system] + messages[: idx + 1],
                                   session=session["id"], turn=turn)
                err = obs["error"] or {}
                if obs["status"] == "failed" and err.get("type") == "context_length_exceeded":
                    stopped.append(f"{session['id']} at turn {turn} (context length exceeded)")
                    break
        if stopped and self._current is not None:
            self._current.reason = "sessions stopped early: " + "; ".join(stopped)

    def _restore_history(self, group: str, sid: str) -> list[dict[str, Any]]:
        """Send every turn of a restore conversation but the last (as `group`); return the
        messages of the last turn (history, the model's replies, a new user message)."""
        notes = FILLER * self.settings.restore_context
        history = [self.system(sid), {"role": "user", "content": RESTORE_ASK.format(notes=notes)}]
        for turn in range(self.settings.restore_turns - 1):
            _, reply = self.send(group, messages=history, session=sid, turn=turn)
            history += [{"role": "assistant", "content": reply},
                        {"role": "user",
                         "content": RESTORE_FOLLOW_UPS[turn % len(RESTORE_FOLLOW_UPS)]}]
        return history

    def _measured_restore(self, group: str, history: list[dict[str, Any]], sid: str) -> None:
        rid = self.next_request_id()
        self.snapshot(f"before:{rid}")
        self.send(group, messages=history, session=sid, turn=self.settings.restore_turns - 1)
        self.snapshot(f"after:{rid}")

    def _host_restore(self) -> None:
        for i in range(self.settings.host_restore):
            sid = f"host-{i}"
            history = self._restore_history("host-restore.setup", sid)
            self.offload("host")
            self._measured_restore("host-restore", history, sid)

    def _restart_restore(self) -> None:
        assert self.restart is not None
        conversations = [(f"restart-{i}", self._restore_history("restart-restore.setup",
                                                                f"restart-{i}"))
                         for i in range(self.settings.restart_restore)]
        self.offload("disk")
        self.snapshot("offloaded:restart-restore")  # the last of this server process
        started = time.monotonic()
        self.restart()
        self.client.reconnect()
        self.log(f"server restarted in {time.monotonic() - started:.1f} s")
        self.snapshot(f"{RESTARTED}restart-restore")  # the first of the new process
        # the new process's first-call costs stay out of the measured group
        self.send("restart-restore.setup", messages=[self.system("restart-warmup"),
                                                     {"role": "user", "content": "Say hello."}])
        for sid, history in conversations:
            self._measured_restore("restart-restore", history, sid)
