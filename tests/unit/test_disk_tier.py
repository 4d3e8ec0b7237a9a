"""Disk tier of conversation state: round trips, rejection of bad records, budget, crashes.

Every test works on real files under tmp_path; the crash test SIGKILLs a real writer
process (tests/unit/disk_tier_writer.py) at random moments and checks what is left.
"""

from __future__ import annotations

import hashlib
import os
import random
import select
import shutil
import signal
import sqlite3
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from flare.state import disk_records, disk_recovery, disk_tier
from flare.state.disk_tier import DiskTier, StateRecord
from flare.state.prefix_index import page_key, root_key

NS = "pkg-a"
OTHER_NS = "pkg-b"  # same length as NS: a swapped file keeps its size
LAYOUT = '{"dtype":"bfloat16","page_size":4}'
BUDGET = 1 << 20
WRITER = Path(__file__).with_name("disk_tier_writer.py")


def _record(kind: str = "page", seed: int = 0, dtype: torch.dtype = torch.bfloat16,
            rows: int = 4, parent: bytes | None = None) -> StateRecord:
    g = torch.Generator().manual_seed(seed)
    parent = root_key(NS) if parent is None else parent
    tokens = tuple(range(seed, seed + (4 if kind == "page" else 3)))
    key = (page_key(parent, tokens) if kind == "page"
           else hashlib.blake2b(f"{kind}-{seed}".encode(), digest_size=16).digest())
    tensors = {"k": torch.randn(2, rows, 2, 8, generator=g).to(dtype),
               "v": torch.randn(2, rows, 2, 8, generator=g).to(dtype),
               "scalar": torch.tensor(seed, dtype=torch.int64)}
    return StateRecord(kind, key, parent, tokens, 4 + seed, tensors)


def _tier(folder: Path, namespace: str = NS, layout: str = LAYOUT,
          budget: int = BUDGET) -> DiskTier:
    return DiskTier(folder, namespace, layout, budget)


def _assert_same(got: StateRecord | None, want: StateRecord) -> None:
    assert got is not None
    assert (got.kind, got.key, got.parent, got.tokens, got.position) == (
        want.kind, want.key, want.parent, want.tokens, want.position)
    assert list(got.tensors) == list(want.tensors)
    for name, t in want.tensors.items():
        assert got.tensors[name].dtype == t.dtype and torch.equal(got.tensors[name], t), name


def _record_file(folder: Path, key: bytes) -> Path:
    (path,) = folder.glob(f"{key.hex()}.*.rec")
    return path


def _payload_offset(path: Path) -> int:
    header_len = struct.unpack_from("<I", path.read_bytes(), 12)[0]
    return 16 + header_len + 32


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


# ---- round trips --------------------------------------------------------------------------

def test_contains_many_answers_as_contains_for_each_key(tmp_path):
    stored = [_record("page", seed=s) for s in range(0, 1200, 2)]  # 600: two IN queries
    absent = [_record("page", seed=s).key for s in range(1, 40, 2)]
    with _tier(tmp_path, budget=1 << 26) as tier:
        for r in stored:
            assert tier.put(r)
        keys = [r.key for r in stored] + absent
        assert tier.contains_many(keys) == {k for k in keys if tier.contains(k)}
        assert tier.contains_many(keys) == {r.key for r in stored}
        assert tier.contains_many([]) == set()
    with _tier(tmp_path, namespace=OTHER_NS, budget=1 << 26) as other:  # not ours
        assert other.contains_many([r.key for r in stored]) == set()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kind", ["page", "tail", "checkpoint"])
def test_round_trip_of_each_kind_survives_reopen(tmp_path, kind, dtype):
    record = _record(kind, seed=7, dtype=dtype)
    with _tier(tmp_path) as tier:
        assert tier.put(record)
        assert tier.contains(record.key) and len(tier) == 1
        _assert_same(tier.get(record.key), record)
        assert tier.nbytes == _record_file(tmp_path, record.key).stat().st_size
        tier.check_integrity()
    with _tier(tmp_path) as tier:
        assert tier.contains(record.key)
        _assert_same(tier.get(record.key), record)
        assert tier.stats.read_hits == 1
        tier.check_integrity()


def test_put_of_a_stored_key_touches_without_rewriting(tmp_path):
    record = _record()
    with _tier(tmp_path) as tier:
        assert tier.put(record)
        before = _record_file(tmp_path, record.key).stat()
        assert tier.put(record)
        after = _record_file(tmp_path, record.key).stat()
        assert (before.st_ino, before.st_mtime_ns) == (after.st_ino, after.st_mtime_ns)
        assert (tier.stats.written, tier.stats.touched) == (1, 1)


def test_children_lists_tails_and_checkpoints_under_their_parent(tmp_path):
    page = _record("page", seed=1)
    tail = _record("tail", seed=2, parent=page.key)
    ckpt = _record("checkpoint", seed=3, parent=page.key)
    with _tier(tmp_path) as tier:
        for r in (page, tail, ckpt):
            assert tier.put(r)
        assert tier.children(page.key, "tail") == [(tail.key, tail.tokens, tail.position)]
        assert tier.children(page.key, "checkpoint") == [
            (ckpt.key, ckpt.tokens, ckpt.position)]
        assert tier.children(root_key(NS), "page") == [(page.key, page.tokens, page.position)]
        assert tier.children(tail.key, "tail") == []
        assert set(tier.keys()) == {page.key, tail.key, ckpt.key}
        assert tier.keys("tail") == [tail.key]
        with pytest.raises(ValueError):
            tier.children(page.key, "pages")


def test_remove_deletes_row_and_file(tmp_path):
    record = _record()
    with _tier(tmp_path) as tier:
        tier.put(record)
        tier.remove(record.key)
        tier.remove(record.key)  # absent: no error
        assert not tier.contains(record.key) and tier.get(record.key) is None
        assert tier.nbytes == 0 and not list(tmp_path.glob("*.rec"))
        tier.check_integrity()


def test_state_record_checks_its_fields():
    with pytest.raises(ValueError):
        StateRecord("page", b"short", bytes(16), (1,), 1, {})
    with pytest.raises(ValueError):
        StateRecord("pages", bytes(16), bytes(16), (1,), 1, {})


def test_unsupported_dtype_is_refused_before_anything_is_written(tmp_path):
    record = StateRecord("page", bytes(16), bytes(16), (1,), 1,
                         {"c": torch.zeros(2, dtype=torch.complex64)})
    with _tier(tmp_path) as tier:
        with pytest.raises(ValueError, match="complex64"):
            tier.put(record)
        assert len(tier) == 0 and not list(tmp_path.glob("*.tmp"))


# ---- rejection ----------------------------------------------------------------------------

def _corrupt_tensor(path: Path) -> None:
    _flip(path, path.stat().st_size - 3)


def _corrupt_header(path: Path) -> None:
    _flip(path, 16 + 10)


def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size - 5)


def _append(path: Path) -> None:
    with open(path, "ab") as f:
        f.write(b"\0")


def _patch_version(path: Path) -> None:
    data = bytearray(path.read_bytes())
    struct.pack_into("<I", data, 8, disk_records.FORMAT_VERSION + 1)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, reason", [
    (_corrupt_tensor, "checksum"), (_corrupt_header, "checksum"), (_truncate, "truncated"),
    (_patch_version, "version"), (_append, "malformed"),
])
def test_damaged_record_is_rejected_whole(tmp_path, damage, reason):
    record = _record(dtype=torch.float32)
    with _tier(tmp_path) as tier:
        tier.put(record)
        path = _record_file(tmp_path, record.key)
        damage(path)
        assert tier.get(record.key) is None
        _assert_rejected(tier, tmp_path, record.key, reason)
    with _tier(tmp_path) as tier:  # and a restart does not bring it back
        assert not tier.contains(record.key) and tier.get(record.key) is None


def test_payload_byte_flip_in_first_tensor_is_caught(tmp_path):
    record = _record()
    with _tier(tmp_path) as tier:
        tier.put(record)
        path = _record_file(tmp_path, record.key)
        _flip(path, _payload_offset(path))
        assert tier.get(record.key) is None
        _assert_rejected(tier, tmp_path, record.key, "checksum")


def test_record_of_another_layout_is_rejected(tmp_path):
    record = _record()
    with _tier(tmp_path) as tier:
        tier.put(record)
    with _tier(tmp_path, layout=LAYOUT.replace("bfloat16", "float16")) as tier:
        assert tier.get(record.key) is None
        _assert_rejected(tier, tmp_path, record.key, "layout")


def test_file_of_another_namespace_under_our_row_is_rejected(tmp_path):
    record = _record()
    with _tier(tmp_path / "a", namespace=OTHER_NS) as other:
        other.put(record)
    foreign = _record_file(tmp_path / "a", record.key)
    with _tier(tmp_path / "b") as tier:
        tier.put(record)
        shutil.copyfile(foreign, _record_file(tmp_path / "b", record.key))
        assert tier.get(record.key) is None
        _assert_rejected(tier, tmp_path / "b", record.key, "namespace")


def _assert_rejected(tier: DiskTier, folder: Path, key: bytes, reason: str) -> None:
    counters = {k: v for k, v in vars(tier.stats).items() if k.startswith("rejected_")}
    assert counters == {k: int(k == f"rejected_{reason}") for k in counters}
    assert [p.name.split(".")[0] for p in (folder / "rejected").iterdir()] == [key.hex()]
    assert not list(folder.glob("*.rec"))
    assert not tier.contains(key) and key not in tier.keys() and len(tier) == 0
    assert tier.nbytes == 0
    tier.check_integrity()


def test_wrong_length_found_at_open_is_rejected(tmp_path):
    record = _record()
    with _tier(tmp_path) as tier:
        tier.put(record)
    _truncate(_record_file(tmp_path, record.key))
    with _tier(tmp_path) as tier:
        assert tier.stats.rejected_truncated == 1 and not tier.contains(record.key)
        assert len(list((tmp_path / "rejected").iterdir())) == 1
        tier.check_integrity()


def test_missing_file_is_dropped_at_open_and_at_get(tmp_path):
    a, b = _record(seed=1), _record(seed=2)
    with _tier(tmp_path) as tier:
        tier.put(a)
        tier.put(b)
        _record_file(tmp_path, a.key).unlink()
        assert tier.get(a.key) is None and tier.stats.rejected_missing == 1
        _record_file(tmp_path, b.key).unlink()
    with _tier(tmp_path) as tier:
        assert tier.stats.rejected_missing == 1 and len(tier) == 0 and tier.nbytes == 0
        tier.check_integrity()


def test_records_of_another_namespace_are_not_offered_but_kept(tmp_path):
    record = _record()
    with _tier(tmp_path, namespace=OTHER_NS) as other:
        other.put(record)
    with _tier(tmp_path) as tier:
        assert not tier.contains(record.key) and tier.get(record.key) is None
        assert len(tier) == 0 and tier.keys() == [] and tier.children(
            record.parent, "page") == []
        assert tier.nbytes > 0  # it still takes room on disk
        assert tier.stats.read_misses == 1 and tier.stats.rejected_namespace == 0
    with _tier(tmp_path, namespace=OTHER_NS) as other:
        _assert_same(other.get(record.key), record)


def test_records_of_another_format_version_are_not_offered(tmp_path, monkeypatch):
    record = _record()
    monkeypatch.setattr(disk_records, "FORMAT_VERSION", disk_records.FORMAT_VERSION + 1)
    with _tier(tmp_path) as newer:
        newer.put(record)
    monkeypatch.undo()
    with _tier(tmp_path) as tier:
        assert not tier.contains(record.key) and tier.get(record.key) is None
        assert tier.put(record)  # our version replaces the other's file
        _assert_same(tier.get(record.key), record)
        assert len(list(tmp_path.glob("*.rec"))) == 1
        tier.check_integrity()


def test_leftover_temp_files_and_orphans_are_deleted_at_open(tmp_path):
    record = _record()
    with _tier(tmp_path) as tier:
        tier.put(record)
    (tmp_path / f"{record.key.hex()}.abc.rec.x1.tmp").write_bytes(b"half a record")
    shutil.copyfile(_record_file(tmp_path, record.key), tmp_path / f"{'ab' * 16}.00.rec")
    with _tier(tmp_path) as tier:
        assert (tier.stats.temp_deleted, tier.stats.orphans_deleted) == (1, 1)
        _assert_same(tier.get(record.key), record)
        tier.check_integrity()


def test_rejected_folder_keeps_only_the_newest_files(tmp_path, monkeypatch):
    monkeypatch.setattr(disk_recovery, "REJECTED_KEEP", 2)
    records = [_record(seed=i) for i in range(3)]
    with _tier(tmp_path) as tier:
        for r in records:
            tier.put(r)
            _corrupt_tensor(_record_file(tmp_path, r.key))
            assert tier.get(r.key) is None
        assert tier.stats.rejected_checksum == 3
    assert sorted(p.name[:32] for p in (tmp_path / "rejected").iterdir()) == sorted(
        r.key.hex() for r in records[1:])


@pytest.mark.parametrize("failing", ["fsync", "index"])
def test_failed_write_leaves_nothing_behind(tmp_path, monkeypatch, failing):
    record = _record()
    with _tier(tmp_path) as tier:
        if failing == "fsync":
            def fail(fd):
                raise OSError(28, "No space left on device")
            monkeypatch.setattr(disk_tier.os, "fsync", fail)
        else:
            def fail(*args):
                raise sqlite3.OperationalError("disk I/O error")
            monkeypatch.setattr(tier, "_insert", fail)
        assert not tier.put(record)
        monkeypatch.undo()
        assert tier.stats.write_failures == 1 and not tier.contains(record.key)
        assert not list(tmp_path.glob("*.rec")) and not list(tmp_path.glob("*.tmp"))
        tier.check_integrity()
        assert tier.put(record)  # and the tier still works
        _assert_same(tier.get(record.key), record)


def test_closed_tier_refuses_calls(tmp_path):
    tier = _tier(tmp_path)
    tier.close()
    tier.close()
    with pytest.raises(RuntimeError, match="closed"):
        tier.put(_record())
    with pytest.raises(RuntimeError, match="closed"):
        tier.get(bytes(16))


def test_a_second_tier_on_the_same_folder_is_refused(tmp_path):
    with _tier(tmp_path):
        with pytest.raises(RuntimeError, match="in use"):
            _tier(tmp_path)
    _tier(tmp_path).close()  # released on close


# ---- budget -------------------------------------------------------------------------------

def _size_of(record: StateRecord) -> int:
    return disk_records.encode(record, NS, LAYOUT).nbytes


def test_budget_evicts_least_recently_used(tmp_path):
    records = [_record(seed=i) for i in range(4)]
    size = _size_of(records[0])
    with _tier(tmp_path, budget=3 * size + size // 2) as tier:
        for r in records[:3]:
            assert tier.put(r)
        assert tier.get(records[0].key) is not None  # touched: records[1] is now the oldest
        assert tier.put(records[3])
        assert tier.keys() == [records[2].key, records[0].key, records[3].key]
        assert tier.stats.evicted == 1 and tier.nbytes <= tier.budget_bytes
        tier.check_integrity()


def test_evicting_a_chain_head_takes_everything_that_hangs_from_it(tmp_path):
    """Written heads first and never touched (a merged write ticket), a chain's head is
    the least recently used row: evicting it takes its pages, tail and checkpoint below,
    which no restore could reach, and leaves an unrelated newer chain whole."""
    head = _record(seed=1)
    middle = _record(seed=2, parent=head.key)
    end = _record(seed=3, parent=middle.key)
    checkpoint = _record("checkpoint", seed=4, parent=middle.key)
    other_head = _record(seed=5)
    other_end = _record(seed=6, parent=other_head.key)
    size = _size_of(head)
    with _tier(tmp_path, budget=5 * size + size // 2) as tier:
        for r in (head, middle, end, checkpoint, other_head):
            assert tier.put(r)
        assert tier.put(other_end)  # one record over: the head goes, and all below it
        assert tier.keys() == [other_head.key, other_end.key]
        assert tier.stats.evicted == 4 and tier.nbytes <= tier.budget_bytes
        assert sorted(p.name for p in tmp_path.glob("*.rec")) == sorted(
            _record_file(tmp_path, r.key).name for r in (other_head, other_end))
        tier.check_integrity()


def test_record_larger_than_the_budget_is_refused(tmp_path):
    small, big = _record(seed=1), _record(seed=2, rows=64)
    with _tier(tmp_path, budget=_size_of(small) + 10) as tier:
        assert tier.put(small)
        assert not tier.put(big)
        assert tier.stats.refused == 1 and tier.contains(small.key)
        assert not list(tmp_path.glob("*.tmp"))
        tier.check_integrity()


def test_smaller_budget_at_reopen_evicts_down_to_it(tmp_path):
    records = [_record(seed=i) for i in range(3)]
    with _tier(tmp_path) as tier:
        for r in records:
            tier.put(r)
    with _tier(tmp_path, budget=_size_of(records[0]) + 10) as tier:
        assert tier.keys() == [records[2].key] and tier.stats.evicted == 2
        tier.check_integrity()


def test_other_namespaces_are_evicted_before_ours(tmp_path):
    foreign, old, new = _record(seed=1), _record(seed=2), _record(seed=3)
    size = _size_of(old)
    with _tier(tmp_path, namespace=OTHER_NS) as other:
        other.put(foreign)
    with _tier(tmp_path, budget=2 * size + size // 2) as tier:
        tier.put(old)
        tier.put(new)  # the foreign record is older than nothing of ours, but goes first
        assert tier.keys() == [old.key, new.key] and tier.stats.evicted == 1
        tier.check_integrity()


def test_stats_have_metric_names(tmp_path):
    with _tier(tmp_path) as tier:
        tier.put(_record())
        names = tier.stats.as_stats()
        assert tier.as_stats() == names
    assert names["disk_tier_written_total"] == 1
    assert all(k.startswith("disk_tier_") and k.endswith("_total") for k in names)
    assert "disk_tier_rejected_checksum_total" in names


# ---- threads and crashes ------------------------------------------------------------------

def test_reader_thread_sees_whole_records_while_writer_evicts(tmp_path):
    records = [_record(seed=i) for i in range(24)]
    by_key = {r.key: r for r in records}
    seen, errors = [], []
    with _tier(tmp_path, budget=5 * _size_of(records[0])) as tier:
        done = threading.Event()

        def reader() -> None:
            rng = random.Random(1)
            while not done.is_set():
                key = rng.choice(records).key
                try:
                    got = tier.get(key)
                    if got is not None:
                        _assert_same(got, by_key[key])
                        seen.append(key)
                except Exception as e:  # noqa: BLE001 - reported below
                    errors.append(e)

        thread = threading.Thread(target=reader)
        thread.start()
        for _ in range(3):
            for r in records:
                assert tier.put(r)
        done.set()
        thread.join()
        assert not errors and seen
        assert not any(v for k, v in vars(tier.stats).items() if k.startswith("rejected_"))
        tier.check_integrity()


class _Lines:
    """Lines of a pipe, read with a deadline (never hangs the test on a stuck writer)."""

    def __init__(self, pipe) -> None:
        self.fd, self.buf = pipe.fileno(), b""

    def next(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.fd], [], [], left)[0]:
                raise TimeoutError("the writer did not answer")
            chunk = os.read(self.fd, 4096)
            if not chunk:
                raise EOFError("the writer exited")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line.decode()


def test_sigkill_at_random_moments_leaves_only_whole_records(tmp_path):
    import disk_tier_writer as writer

    rng = random.Random(20240607)
    folder, budget = tmp_path / "tier", 40_000
    stderr = open(tmp_path / "writer.stderr", "wb")  # noqa: SIM115 - closed below
    server = subprocess.Popen([sys.executable, str(WRITER)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=stderr)
    lines, offered = _Lines(server.stdout), set()
    try:
        for trial in range(24):
            server.stdin.write(f"{folder} {budget} {trial}\n".encode())
            server.stdin.flush()
            ready = lines.next(timeout=60)
            assert ready.startswith("ready "), (ready, (tmp_path / "writer.stderr").read_text())
            pid = int(ready.split()[1])
            time.sleep(rng.uniform(0.02, 0.2))
            os.kill(pid, signal.SIGKILL)
            _, _, status = lines.next(timeout=30).split()
            assert os.WIFSIGNALED(int(status)), "the writer ended before it was killed"
            offered |= _check_after_crash(folder, budget, writer)
    finally:
        server.stdin.close()
        server.wait(timeout=30)
        stderr.close()
    assert len(offered) > 20  # the writer really wrote (and evicted) between the kills


def _check_after_crash(folder: Path, budget: int, writer) -> set[bytes]:
    """Reopen after a kill: every offered record is whole and exactly what was written."""
    with DiskTier(folder, writer.NAMESPACE, writer.LAYOUT, budget) as tier:
        assert not list(folder.glob("*.tmp"))
        tier.check_integrity()
        keys = tier.keys()
        for key in keys:
            _assert_same(tier.get(key), writer.make_record(key))
        rejected = {k: v for k, v in vars(tier.stats).items() if k.startswith("rejected_")}
        assert not any(rejected.values()), rejected
        assert not list((folder / "rejected").iterdir())
    return set(keys)


# ---- a damaged index (issue 23) -----------------------------------------------------------


def _damage_index(folder: Path, how: str) -> None:
    index = folder / "index.sqlite"
    if how == "garbage":  # not a database at all
        index.write_bytes(b"this is not an sqlite file" * 100)
        for extra in ("index.sqlite-wal", "index.sqlite-shm"):
            (folder / extra).unlink(missing_ok=True)
    else:  # "pages": the header survives, the b-tree pages do not ("disk image is malformed")
        data = bytearray(index.read_bytes())
        page = struct.unpack(">H", data[16:18])[0] or 65536
        for i in range(page + 8, len(data), 7):
            data[i] = (data[i] * 31 + 7) & 0xFF
        index.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["garbage", "pages"])
def test_a_damaged_index_is_moved_aside_and_rebuilt_from_verified_records(tmp_path, how,
                                                                            caplog):
    records = [_record(seed=i) for i in range(5)]
    with _tier(tmp_path) as tier:
        for r in records:
            assert tier.put(r)
        tier._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # rows in the main file
    with _tier(tmp_path, namespace=OTHER_NS) as other:  # another package's record
        assert other.put(_record(seed=9))
    _flip(_record_file(tmp_path, records[3].key), _payload_offset(
        _record_file(tmp_path, records[3].key)) + 1)  # one record damaged as well
    _damage_index(tmp_path, how)
    with caplog.at_level("WARNING", logger="flare.state.disk_tier"), _tier(tmp_path) as tier:
        assert tier.stats.index_rebuilds == 1
        assert tier.stats.rejected_checksum == 1 and tier.stats.written == 0
        assert len(tier) == 4 and not tier.contains(records[3].key)
        for i, r in enumerate(records):
            if i != 3:
                _assert_same(tier.get(r.key), r)
        assert tier.get(records[3].key) is None
        tier.check_integrity()
    log = caplog.text
    assert "4 kept, 1 rejected" in log and "1 of other packages dropped" in log
    aside = [p.name for p in (tmp_path / "rejected").iterdir()]
    assert any(n.startswith("index.sqlite.") and n.endswith(".damaged") for n in aside), aside
    # the rebuilt index is an ordinary one: a reopen finds everything without a rebuild
    with _tier(tmp_path) as tier:
        assert tier.stats.index_rebuilds == 0 and len(tier) == 4
        assert tier.put(records[3]) and len(tier) == 5


def test_an_unreadable_folder_is_not_mistaken_for_a_damaged_index(tmp_path):
    """Only damage triggers a rebuild: a locked or unopenable index still raises."""
    with _tier(tmp_path) as tier:
        tier.put(_record())
    (tmp_path / "index.sqlite").unlink()
    (tmp_path / "index.sqlite").mkdir()  # cannot be opened as a file
    with pytest.raises(sqlite3.OperationalError):
        _tier(tmp_path)
