"""The AVX-512 int8 kernels' register width at few rows of x (`flare.kernels.register_width`):
the choice follows the measured times, is measured once per build and kept under the
build's key, and `qgemm()` runs with what was kept. (That both widths give the same bits
is test_kernel_variants' job.) On a CPU without AVX-512 the measured parts are skipped,
saying so."""

from __future__ import annotations

import json

import pytest

K = pytest.importorskip("flare.kernels")
from flare.kernels import register_width, variants


def _avx512_module():
    """This CPU's AVX-512 kernel module, or a skip saying why there is none."""
    if K.qgemm_problem() is not None:
        pytest.skip(f"Flare's kernels: {K.qgemm_problem()}")
    name = K.isa_variant()
    if not variants.has_two_widths(name):
        pytest.skip(f"this CPU runs the {name} kernels: one register width, nothing to choose")
    return name, K.variant_module(name)


def test_the_choice_is_the_smallest_row_count_from_which_zmm_keeps_up():
    def times(ymm_faster_at):  # Z16 / Y8 time ratios
        return {r: 1.25 if r in ymm_faster_at else 1.0 for r in register_width.ROW_COUNTS}

    assert register_width.choose(times(set())) == 1  # Z16 everywhere (the Xeon)
    assert register_width.choose(times({1, 2, 4})) == 8  # Y8 at few rows (the Zen 4)
    assert register_width.choose(times({1})) == 2
    assert register_width.choose(times({1, 2, 4, 8})) == register_width.ABOVE_ALL
    # a win at a larger count is not undone by a loss at a smaller one: 2 loses, so Z16
    # starts at 4, above every count where Y8 won
    assert register_width.choose(times({2})) == 4
    # within the margin is no win: Z16 stays
    near = {r: 1 / (1 - register_width.MARGIN / 2) for r in register_width.ROW_COUNTS}
    assert register_width.choose(near) == 1


def test_measured_once_kept_under_the_build_key_and_remeasured_for_another(tmp_path):
    _, module = _avx512_module()
    before = module.zmm_min_rows()
    record = tmp_path / "width.json"
    rows = register_width.zmm_min_rows(module, record, "key-a")
    assert module.zmm_min_rows() == before  # measuring leaves the module's setting alone
    saved = json.loads(record.read_text())
    assert saved["key"] == "key-a" and saved["zmm_min_rows"] == rows
    assert saved["weight_bytes"] == register_width.WEIGHT_BYTES
    assert rows in (*register_width.ROW_COUNTS, register_width.ABOVE_ALL)
    assert sorted(saved["zmm_over_ymm"]) == sorted(str(r) for r in register_width.ROW_COUNTS)
    assert all(q > 0 for q in saved["zmm_over_ymm"].values())
    # the same key reads the record (a value that was not measured proves it is read) ...
    record.write_text(json.dumps({**saved, "zmm_min_rows": 3}))
    assert register_width.zmm_min_rows(module, record, "key-a") == 3
    # ... one measured over other weight bytes (45 MiB, before 192) is measured again ...
    record.write_text(json.dumps({**saved, "zmm_min_rows": 3, "weight_bytes": 45 << 20}))
    assert register_width.zmm_min_rows(module, record, "key-a") in (
        *register_width.ROW_COUNTS, register_width.ABOVE_ALL)
    assert json.loads(record.read_text())["weight_bytes"] == register_width.WEIGHT_BYTES
    # ... another build's key measures again and keeps its own answer
    again = register_width.zmm_min_rows(module, record, "key-b")
    assert json.loads(record.read_text())["key"] == "key-b"
    assert again in (*register_width.ROW_COUNTS, register_width.ABOVE_ALL)
    # a record that cannot be parsed is measured over, never an error
    record.write_text("{not json")
    assert register_width.zmm_min_rows(module, record, "key-a") in (
        *register_width.ROW_COUNTS, register_width.ABOVE_ALL)


def test_qgemm_runs_with_the_width_kept_for_its_build():
    name, _ = _avx512_module()
    folder = K.module_folder(name)
    saved = json.loads((folder.parent / f"{folder.name}.width.json").read_text())
    assert saved["key"] == K.build_key(name)
    assert K.qgemm().zmm_min_rows() == saved["zmm_min_rows"]
