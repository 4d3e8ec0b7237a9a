"""The bare `flare` command and `--version`: what a newcomer types first."""

from __future__ import annotations

import pytest

import flare
from flare.cli import main


def test_plain_flare_prints_the_commands_and_how_to_start(capsys):
    assert main([]) == 2
    out = capsys.readouterr().out
    for word in ("prepare", "serve", "qualify", "evidence", "flare serve --embedded"):
        assert word in out


def test_version_names_flare_and_torch(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"flare {flare.__version__} (torch ") and "2.13" in out
