"""What a qualification run sends: its fixed prompt texts, and how many requests of each
scenario (`Settings`; `flare.qualify.scenarios` runs them).

The texts are fixed so that every run sends the same prompts; uniqueness (nothing to
reuse) comes from the ids the scenarios put in front of them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

SYSTEM = "You are a helpful assistant for software developers. Answer briefly."
QUESTIONS = [
    "What does a Python context manager do? Give a short example.",
    "Explain the difference between a list and a tuple in Python.",
    "How do I read a JSON file in Python and print one of its keys?",
    "What is a race condition, in two sentences?",
    "Write a shell command that counts the lines of every .py file in a folder.",
    "When should I use a dataclass instead of a dict?",
]
FOLLOW_UPS = [
    "Thanks. Now show how to test that with pytest.",
    "Can you make it shorter?",
    "What could go wrong with that approach?",
]
FILLER = (
    "The scheduler admits waiting sequences while free pages remain, splits long prompts into "
    "chunks of at most the batch token budget, and runs decode steps for every running "
    "sequence together. Each page holds the keys and values of a fixed number of tokens for "
    "every layer. When a request finishes, its pages return to the pool, unless the prefix "
    "index still lists them for reuse by a later request with the same beginning. Streaming "
    "responses send each piece of text as soon as it is known not to end in a stop string. "
)
RESTORE_ASK = "Here are my notes on the server's scheduler:\n\n{notes}\nSummarize them in one line."
RESTORE_FOLLOW_UPS = [
    "Which part decides when a page is evicted?",
    "How would you test that?",
    "Name one risk of this design.",
    "What would you measure first?",
]


@dataclass(frozen=True)
class Settings:
    """How much a run does. `quick()` is the preset the tests use."""

    preset: str = "default"
    max_tokens: int = 32
    warmup: int = 1
    ttft_samples: int = 20
    ttft_prompt_tokens: int = 512
    miss: int = 4
    device_hit: int = 3
    cancel: int = 2
    branch: int = 2
    host_restore: int = 3  # conversations
    restart_restore: int = 2  # conversations, all restored after one restart; 0: skip
    restore_turns: int = 3  # turns per restore conversation; the last is measured
    restore_context: int = 8  # FILLER paragraphs (about 110 tokens each) in the first turn
    cancel_max_tokens: int = 64
    sessions: int | None = None  # None: every corpus session
    max_turns: int | None = None  # None: every turn
    cold: bool = True
    idle_timeout_s: float = 30.0

    @classmethod
    def quick(cls, **overrides: Any) -> Settings:
        base = cls(preset="quick", max_tokens=4, ttft_samples=5, miss=1, device_hit=1,
                   cancel=1, branch=1, host_restore=1, restart_restore=1, restore_turns=2,
                   restore_context=4, cancel_max_tokens=16, sessions=1, max_turns=3)
        return replace(base, **overrides)
