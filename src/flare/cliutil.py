"""Argparse pieces shared by the `flare` command lines: value types whose bad values are
reported in one line, and a parser whose errors are one line (no usage dump).

Standard library only, so every command-line module can import it without a cycle.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import NoReturn, TypeVar

T = TypeVar("T", int, float)


class OneLineParser(argparse.ArgumentParser):
    """ArgumentParser whose errors are one line (no usage dump), exit status `exit_status`."""

    exit_status = 2

    def error(self, message: str) -> NoReturn:
        self.exit(self.exit_status, f"{self.prog}: error: {message}\n")


def _convert(text: str, kind: Callable[[str], T], expected: str) -> T:
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None


def positive_int(text: str) -> int:
    value = _convert(text, int, "a positive integer")
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = _convert(text, int, "an integer >= 0")
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def port(text: str) -> int:
    value = _convert(text, int, "a port number")
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port in 1..65535, got {value}")
    return value


def positive_seconds(text: str) -> float:
    """A finite number of seconds > 0."""
    value = _convert(text, float, "a number of seconds")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text}")
    return value


def positive_number(text: str) -> float:
    """A number > 0 (infinity included)."""
    value = _convert(text, float, "a number")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {value}")
    return value
