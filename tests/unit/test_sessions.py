"""Named sessions: name checks, fork, delete, and persistence of saved sessions only."""

from __future__ import annotations

import pytest

from flare.state.sessions import SessionError, SessionRegistry, check_name


@pytest.mark.parametrize("name", ["a", "agent-7", "A.b_c-9", "x" * 128])
def test_valid_names(name):
    assert check_name(name) == name


@pytest.mark.parametrize("name", ["", "../etc", "a/b", ".hidden", "-x", "x" * 129, "a b",
                                  "é", "a\x00b"])
def test_names_that_could_become_paths_or_garbage_are_refused(name):
    with pytest.raises(SessionError, match="not valid"):
        check_name(name)


def test_saved_sessions_persist_and_others_do_not(tmp_path):
    reg = SessionRegistry(tmp_path, "pkg-a")
    reg.record("saved", [1, 2, 3, 4])
    reg.record("volatile", [5, 6])
    reg.mark_saved("saved", [1, 2, 3, 4], 3)
    reopened = SessionRegistry(tmp_path, "pkg-a")
    assert reopened.get("saved").tokens == [1, 2, 3, 4]
    assert reopened.get("saved").saved_tokens == 3
    with pytest.raises(SessionError) as err:
        reopened.get("volatile")
    assert err.value.missing
    assert len(SessionRegistry(tmp_path, "pkg-b")) == 0  # another package reads nothing


def test_fork_and_delete(tmp_path):
    reg = SessionRegistry(None, "pkg")
    reg.record("main", [1, 2, 3])
    reg.fork("main", "branch")
    reg.record("branch", [1, 2, 3, 9])
    assert reg.get("main").tokens == [1, 2, 3]  # the branch does not touch the original
    with pytest.raises(SessionError, match="already exists"):
        reg.fork("main", "branch")
    reg.delete("main")
    with pytest.raises(SessionError):
        reg.get("main")
    assert reg.get("branch").tokens == [1, 2, 3, 9]


def test_a_new_state_that_diverges_before_the_saved_part_is_no_longer_saved():
    reg = SessionRegistry(None, "pkg")
    reg.record("s", [1, 2, 3, 4])
    assert reg.mark_saved("s", [1, 2, 3, 4], 4)
    reg.record("s", [1, 2, 3, 4, 5])
    assert reg.get("s").saved_tokens == 4
    reg.record("s", [1, 9])
    assert reg.get("s").saved_tokens == 0


@pytest.mark.parametrize("body", ["{not json", "[]", '{"format": 1, "namespace": "pkg", '
                                  '"sessions": [1]}', '{"format": 1, "namespace": "pkg", '
                                  '"sessions": {"s": {"tokens": ["x"], "saved_tokens": 1}}}',
                                  '{"format": 1, "namespace": "pkg", "sessions": {"s": '
                                  '{"tokens": [1], "saved_tokens": null}}}'])
def test_a_damaged_or_malformed_file_starts_empty(tmp_path, body):
    reg = SessionRegistry(tmp_path, "pkg")
    reg.record("s", [1])
    reg.mark_saved("s", [1], 1)
    reg.path.write_text(body)
    assert len(SessionRegistry(tmp_path, "pkg")) == 0


def test_a_save_never_resurrects_a_deleted_session_nor_overwrites_a_newer_state():
    reg = SessionRegistry(None, "pkg")
    reg.record("gone", [1, 2])
    reg.delete("gone")
    assert not reg.mark_saved("gone", [1, 2], 2)
    with pytest.raises(SessionError):
        reg.get("gone")
    reg.record("moved", [1, 2, 3])
    reg.record("moved", [7])  # a request on the session finished during the save
    assert not reg.mark_saved("moved", [1, 2, 3], 3)
    assert reg.get("moved").tokens == [7] and reg.get("moved").saved_tokens == 0
