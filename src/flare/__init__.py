"""Flare: a local LLM inference server (prepare a runtime package, then serve it)."""

__version__ = "0.1.0"
