"""The engine's step loop: schedule -> run -> sample -> publish -> emit, one step at a time
on the engine thread. Mixed into `flare.runtime.engine.Engine`, which builds the pools,
scheduler and model this loop drives; the forward itself is `flare.runtime.forward`."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from flare.runtime.detokenize import IncrementalDetokenizer
from flare.runtime.request import GenerationRequest, RequestOutput, RequestTimings
from flare.runtime.sampling import PenaltyCounts, TokenHistory, sample
from flare.runtime.scheduler import ScheduledChunk
from flare.runtime.sequence import SeqStatus, Sequence
from flare.runtime.stop_strings import StopStringMatcher

log = logging.getLogger(__name__)


@dataclass
class SeqText:
    """Text-side state of a sequence: detokenizer and stop-string matcher."""

    detok: IncrementalDetokenizer
    stops: StopStringMatcher
    stop_ids: frozenset[int]


class StepLoop:
    """Part of `Engine` (see the module docstring)."""

    # ---- the step loop ------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not (self._stopping or self._inbox or self._aborts or self._commands
                           or (self.scheduler.has_work()
                               and not self.scheduler.waiting_on_transfers)
                           # write-through records held while a write ran: send them
                           or (self.tiers is not None and self.tiers.writes_ready)):
                    # with every request waiting on a transfer ticket, its completion
                    # notifies; the timeout only bounds a missed notification
                    self._wake.wait(0.1 if self.scheduler.has_work() else None)
                if self._stopping:
                    break
            self.step()
        for seq in list(self._seqs.values()):
            self._finish(seq, "abort", error="server shutting down")

    def _drain_inbox(self) -> None:
        with self._wake:
            inbox = list(self._inbox)  # left in the inbox until admitted (`num_waiting`)
            aborts, self._aborts = self._aborts, []
            commands, self._commands = self._commands, []
        for fn, fut in commands:
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as exc:  # reaches the caller, never the step loop
                    fut.set_exception(exc)
        admitted = 0
        try:
            for req in inbox:
                self._admit(req)
                admitted += 1
        finally:
            with self._wake:  # what was not admitted (a failure) leaves the inbox too
                del self._inbox[:len(inbox) - admitted]  # later arrivals come after these
        for rid in aborts:
            seq = self._seqs.get(rid)
            if seq is not None:
                self._finish(seq, "abort")

    def _admit(self, req: GenerationRequest) -> None:
        p = req.params
        gen = torch.Generator()
        gen.manual_seed(p.seed if p.seed is not None
                        else int(torch.randint(0, 2**62, (1,), generator=self._seed_rng)))
        n = len(req.prompt_token_ids)
        seq = Sequence(request=req, token_ids=list(req.prompt_token_ids), num_prompt_tokens=n,
                       max_len=min(self.plan.max_seq_len, n + p.max_tokens), generator=gen)
        stop_ids = set(p.stop_token_ids)
        if not p.ignore_eos:
            stop_ids |= self.eos_token_ids
        self._text[req.request_id] = SeqText(IncrementalDetokenizer(self._detok_tokenizer),
                                              StopStringMatcher(p.stop), frozenset(stop_ids))
        self._seqs[req.request_id] = seq
        self.counters.prompt_tokens_total += n
        with self._wake:  # into the waiting queue and out of the inbox at once: an exact
            self.scheduler.add(seq)  # `num_waiting` for the queue bound, never counted twice
            del self._inbox[0]  # this request: the inbox's oldest

    def step(self) -> bool:
        """One engine step: take inbox, aborts and commands, schedule, forward, sample, emit
        outputs. Returns False when nothing was scheduled."""
        self._drain_inbox()
        chunks = self.scheduler.schedule()
        if self.tiers is not None:  # what this step's evictions pushed out of the host tier
            self.tiers.submit_writes()
        if not chunks:
            return False
        now = time.monotonic_ns()
        for c in chunks:
            if c.seq.scheduled_ns is None:
                c.seq.scheduled_ns = now
        self.counters.steps_total += 1
        try:
            tokens = self._run(chunks)
        except Exception as exc:  # a failed step fails its requests, never the server
            log.exception("engine step failed")
            self.counters.failed_steps_total += 1
            for c in chunks:
                self._finish(c.seq, "abort", error=f"engine step failed: {exc}")
            return True
        sampled = [c.seq for c in chunks if c.samples]
        for c in chunks:
            seq = c.seq
            before = seq.num_computed
            prefill = seq.is_prefilling or c.num_tokens > 1
            seq.num_computed += c.num_tokens
            self._publish_full_pages(seq)  # after the step: their K/V is written
            if self.checkpoints is not None:  # and the state slot is at num_computed
                n, every = seq.num_computed, self.checkpoint_interval
                if (before < seq.num_prompt_tokens == n  # end of the prompt
                        # one before it: the endpoint of the very same prompt sent again
                        or before < seq.num_prompt_tokens - 1 == n
                        or (prefill and every and n % every == 0)):  # the prefill grid
                    self._checkpoint(seq)
        for seq, tok in zip(sampled, tokens):
            self._append(seq, tok)
        if self.tiers is not None:  # what this step's finishes wrote through
            self.tiers.submit_writes()
        return True

    @torch.inference_mode()
    def _run(self, chunks: list[ScheduledChunk]) -> list[int]:
        """Forward the chunks and sample a token for every chunk that reaches its end.

        A step of single tokens only (decode) goes through the static decode runner when
        there is one and a bucket fits; everything else runs the eager path."""
        sampling = [c.seq for c in chunks if c.samples]
        logits = None
        if self.decoder is not None and all(c.num_tokens == 1 for c in chunks):
            logits = self._run_static(chunks)
            if logits is not None and len(sampling) != len(chunks):
                rows = [i for i, c in enumerate(chunks) if c.samples]
                logits = logits[torch.tensor(rows, device=logits.device)]
        else:
            self.counters.eager_steps_total += 1
            logits = self._run_eager(chunks)
        if logits is None or not sampling:
            return []
        return self._sample(sampling, logits)

    def _sample(self, sampling: list[Sequence], logits: torch.Tensor) -> list[int]:
        """A token for each sequence of `sampling` from its row of fp32 logits [N, vocab]
        (on any device; on a GPU, plain greedy rows are picked there and only the token
        ids cross to the host, otherwise the logits are copied to the host once, where
        the per-request generators live)."""
        if logits.device.type != "cpu" and not all(
                s.request.constraint is None and s.request.params.greedy
                and s.request.params.logprobs is None and not s.request.params.penalized
                and not s.request.params.logit_bias for s in sampling):
            logits = logits.cpu()
        for row, seq in enumerate(sampling):
            constraint = seq.request.constraint
            allowed = constraint.allowed(logits.shape[-1]) if constraint is not None else None
            if allowed is not None:
                logits[row].masked_fill_(~allowed.to(logits.device), float("-inf"))
        vocab = logits.shape[-1]
        for seq in sampling:
            if seq.penalty_counts is None and seq.request.params.penalized:
                seq.penalty_counts = PenaltyCounts(vocab)
        result = sample(logits, [s.request.params for s in sampling],
                        [s.generator for s in sampling],
                        [TokenHistory(s.token_ids, s.num_prompt_tokens, s.penalty_counts)
                         for s in sampling])
        # read by _append/_emit of this step: the logprob goes out with its token
        self._sampled_logprobs = {s.request_id: lp for s, lp in zip(sampling, result.logprobs)
                                  if lp is not None}
        return result.tokens

    def _publish_full_pages(self, seq: Sequence) -> None:
        """List every computed, not yet listed full page of `seq` in the prefix index."""
        index = self.prefix_index
        if index is None:
            return
        ps = self.plan.page_size
        while (len(seq.page_keys) + 1) * ps <= seq.num_computed:
            i = len(seq.page_keys)
            parent = seq.page_keys[-1] if seq.page_keys else index.root
            key, page = index.publish_full(parent, tuple(seq.token_ids[i * ps:(i + 1) * ps]),
                                           seq.pages[i])
            seq.pages[i] = page  # an equal page was already listed: share it
            seq.page_keys.append(key)

    def _publish_tail(self, seq: Sequence) -> None:
        """List the computed part of `seq`'s last, partly filled page (end of prompt or of
        generation), so the next turn can reuse the whole conversation."""
        index = self.prefix_index
        if index is None:
            return
        ps = self.plan.page_size
        i = len(seq.page_keys)
        if i < len(seq.pages) and seq.num_computed > i * ps:
            parent = seq.page_keys[-1] if seq.page_keys else index.root
            index.publish_tail(parent, tuple(seq.token_ids[i * ps:seq.num_computed]),
                               seq.pages[i])

    def _checkpoint(self, seq: Sequence) -> None:
        """Publish a checkpoint of `seq`'s state slot at `seq.num_computed` (hybrid
        recipes; between steps, after the step that produced the state completed). Keyed
        by the chained key of its full pages and the tokens of its partial page. A failed
        copy publishes nothing and never fails the request."""
        ckpts, index = self.checkpoints, self.prefix_index
        p = seq.num_computed
        if ckpts is None or index is None or seq.state_slot < 0 or p == 0:
            return
        ps = self.plan.page_size
        full = p // ps
        if len(seq.page_keys) < full:  # its pages are not all listed: nothing to back it
            return
        parent = seq.page_keys[full - 1] if full else index.root
        try:
            ckpts.publish(parent, tuple(seq.token_ids[full * ps:p]), p, seq.state_slot,
                          self._checkpoint_usable)
        except Exception:
            log.exception("checkpoint of %s at position %d failed", seq.request_id, p)

    def _checkpoint_usable(self, ckpt: Any) -> bool:
        """Whether a checkpoint can still be adopted: its KV pages are listed, or a running
        sequence holds them (its partly filled page is published when it finishes: the
        checkpoints at a prompt's end and the token before it are taken while it runs, and
        must not be the first retired)."""
        if self._reuse.checkpoint_usable(ckpt):
            return True
        ps, p = self.plan.page_size, ckpt.position
        full = p // ps
        for seq in self.scheduler.running:
            if (seq.num_computed >= p and len(seq.page_keys) >= full
                    and (seq.page_keys[full - 1] if full else self.prefix_index.root)
                    == ckpt.parent and tuple(seq.token_ids[full * ps:p]) == ckpt.tail):
                return True
        return False

    def _append(self, seq: Sequence, token: int) -> None:
        """Add a sampled token to `seq`, decide whether it finished, and emit its output."""
        text_state = self._text[seq.request_id]
        if seq.first_token_ns is None:
            seq.first_token_ns = time.monotonic_ns()
        seq.token_ids.append(token)
        self.counters.generation_tokens_total += 1
        constraint = seq.request.constraint
        if token in text_state.stop_ids:
            if seq.request.params.logprobs is not None:  # not part of the text: no logprob
                self._sampled_logprobs.pop(seq.request_id, None)
            self._finish(seq, self._stop_reason(constraint), new_tokens=[token])
            return
        if constraint is not None:
            constraint.advance(token)
        text, stopped = text_state.stops.push(text_state.detok.push(token))
        if stopped or (constraint is not None and constraint.is_done()):
            self._finish(seq, self._stop_reason(constraint), new_tokens=[token], text=text)
        elif len(seq.token_ids) >= seq.max_len:
            self._finish(seq, "length", new_tokens=[token], text=text)
        else:
            self._emit(seq, [token], text)

    def _stop_reason(self, constraint: Any) -> str:
        """"stop", or "grammar_error" when the request's constraint gave up (its output
        is then not what the grammar promised, so it must not end as a clean stop)."""
        if constraint is not None and getattr(constraint, "error", None):
            self.counters.grammar_failures_total += 1
            return "grammar_error"
        return "stop"

    def _finish(self, seq: Sequence, reason: str, *, new_tokens: list[int] | None = None,
                text: str = "", error: str | None = None) -> None:
        if seq.status is SeqStatus.FINISHED:
            return
        text_state = self._text.pop(seq.request_id)
        if reason != "abort" and not text_state.stops.stopped:
            # the sequence ended by length or a stop token: held-back text is final now
            text += text_state.stops.push(text_state.detok.flush())[0]
            text += text_state.stops.flush()
        if error is None:  # a failed step may have left this sequence's last page half written
            self._publish_tail(seq)
            self._checkpoint(seq)  # end of generation: the state at num_computed
            named = seq.request.session is not None and reason != "abort"
            if named:
                self._keep_session(seq)
            if self.tiers is not None:
                self._write_through(seq, named)
        self.scheduler.finish(seq)
        del self._seqs[seq.request_id]
        seq.finish_reason = reason  # type: ignore[assignment]
        if reason == "abort":
            self.counters.requests_aborted_total += 1
        else:
            self.counters.requests_finished_total += 1
        timings = RequestTimings(seq.request.arrival_ns, seq.scheduled_ns, seq.first_token_ns,
                                 time.monotonic_ns())
        self._emit(seq, new_tokens or [], text, finished=True, timings=timings, error=error)

    def _emit(self, seq: Sequence, tokens: list[int], text: str, *, finished: bool = False,
              timings: RequestTimings | None = None, error: str | None = None) -> None:
        logprobs = None
        if seq.request.params.logprobs is not None:
            # tokens reach _emit only through _append, after _run set the step's logprobs
            lp = self._sampled_logprobs.pop(seq.request_id, None) if tokens else None
            logprobs = (lp,) if lp is not None else ()
        out = RequestOutput(
            request_id=seq.request_id, token_ids=tokens, text=text, finished=finished,
            finish_reason=seq.finish_reason if finished else None,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_completion_tokens=seq.num_completion_tokens,
            num_cached_tokens=seq.num_cached_tokens, timings=timings, error=error,
            reuse=seq.reuse if finished else None, logprobs=logprobs)
        try:
            self.on_output(out)
        except Exception:  # a broken consumer must not stop the step loop
            log.exception("output callback failed for %s", seq.request_id)
