"""`flare serve` limit flags reach `ServerSettings`, and bad values are refused (issue 10)."""

from __future__ import annotations

import pytest

from flare.cli import build_parser
from flare.server.app import ServerSettings


def test_limit_flags_parse_with_documented_defaults():
    args = build_parser().parse_args(["serve", "--embedded"])
    assert args.max_messages == 2048 and args.request_timeout is None
    args = build_parser().parse_args(["serve", "--embedded", "--max-messages", "16",
                                      "--request-timeout", "2.5"])
    assert args.max_messages == 16 and args.request_timeout == 2.5
    settings = ServerSettings(max_messages=args.max_messages,
                              request_timeout_s=args.request_timeout)
    assert settings.request_timeout_s == 2.5


@pytest.mark.parametrize("flag,value", [("--request-timeout", "0"), ("--request-timeout", "-1"),
                                        ("--request-timeout", "nan"), ("--request-timeout", "x"),
                                        ("--max-messages", "0")])
def test_bad_limit_values_exit_2_with_one_line(flag, value, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["serve", "--embedded", flag, value])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and flag in err


@pytest.mark.parametrize("kwargs", [{"max_messages": 0}, {"request_timeout_s": 0},
                                    {"request_timeout_s": float("nan")}])
def test_settings_refuse_nonsense_limits(kwargs):
    with pytest.raises(ValueError):
        ServerSettings(**kwargs)


def test_threads_and_log_level_flags():
    args = build_parser().parse_args(["serve", "--embedded"])
    assert (args.threads, args.log_level) == (None, "info")
    args = build_parser().parse_args(["serve", "--embedded", "--threads", "1",
                                      "--log-level", "debug"])
    assert (args.threads, args.log_level) == (1, "debug")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--embedded", "--log-level", "loud"])


def test_serving_threads_follow_the_package_but_never_exceed_the_cores():
    from flare.runtime.boot import usable_cores, serving_threads

    cores, _ = usable_cores()
    assert serving_threads({"torch_num_threads": 1}) == 1
    assert serving_threads({"torch_num_threads": cores + 64}) == cores  # prepared elsewhere
    assert serving_threads({}) == cores
    assert serving_threads({"torch_num_threads": 1}, requested=3) == 3  # the user decides


def test_serve_embedded_passes_the_weight_format_to_its_package(monkeypatch, tmp_path):
    import flare.prepare.package as package
    from flare.cli import cmd_serve

    seen = {}

    class Stop(Exception):
        pass

    def fake_ensure_package(model_path, cache_dir, **kwargs):
        seen.update(kwargs)
        raise Stop

    monkeypatch.setattr(package, "ensure_package", fake_ensure_package)
    for argv, want in ((["--weights", "q4x8"], "q4x8"), ([], None)):
        args = build_parser().parse_args(["serve", "--embedded", "--cache-dir", str(tmp_path),
                                          *argv])
        with pytest.raises(Stop):
            cmd_serve(args)
        assert seen["weights"] == want
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--embedded", "--weights", "q3"])


@pytest.mark.parametrize("argv", [["--weights", "q4x8"], ["--num-pages", "64"],
                                  ["--max-seq-len", "128", "--dtype", "bfloat16"]])
def test_serve_pkg_refuses_flags_that_only_shape_an_embedded_package(argv, tmp_path):
    from flare.cli import cmd_serve

    args = build_parser().parse_args(["serve", str(tmp_path), *argv])
    with pytest.raises(ValueError, match=f"{argv[0]}.*keeps the plan and weights"):
        cmd_serve(args)


def test_header_and_body_timeout_flags_reach_the_settings():
    """Issue 23: --header-timeout (default 10 s) and --body-timeout (default 30 s)."""
    args = build_parser().parse_args(["serve", "--embedded"])
    assert (args.header_timeout, args.body_timeout) == (10.0, 30.0)
    args = build_parser().parse_args(["serve", "--embedded", "--header-timeout", "2",
                                      "--body-timeout", "0.5"])
    settings = ServerSettings(header_timeout_s=args.header_timeout,
                              body_timeout_s=args.body_timeout)
    assert (settings.header_timeout_s, settings.body_timeout_s) == (2.0, 0.5)
    for flag in ("--header-timeout", "--body-timeout"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "--embedded", flag, "0"])
    with pytest.raises(ValueError):
        ServerSettings(body_timeout_s=0)
    with pytest.raises(ValueError):
        ServerSettings(header_timeout_s=-1)


def test_start_up_objects_are_frozen_out_of_every_collection():
    """What exists when the server has started is never walked by a collection again
    (gc.get_objects lists the objects in the collector's generations); what comes after
    still is."""
    import gc

    from flare.runtime.boot import freeze_startup_objects

    before = [object(), {"a": [1, 2]}]
    try:
        frozen = freeze_startup_objects()
        assert frozen >= 2
        after = {"b": [3]}
        tracked = {id(o) for o in gc.get_objects()}
        assert id(before[1]) not in tracked and id(before) not in tracked
        assert id(after) in tracked
    finally:
        gc.unfreeze()  # the rest of the test session collects as before
