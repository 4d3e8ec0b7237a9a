"""The int8 kernels' weight prefetch hint (`flare.kernels.weight_prefetch`): non-temporal only
on AMD for weights larger than the last-level cache (read from sysfs, the vendor from
/proc/cpuinfo); the same bytes out of every kernel with either hint; and a model's native
layers set it for their own bytes."""

from __future__ import annotations

import pytest
import torch

K = pytest.importorskip("flare.kernels")
from flare.kernels import probe, weight_prefetch
from flare.models.native_layers import native_layers, spec_bytes
from flare.models.quant.storage import convert_tensors
from flare.package.plan import make_plan
from flare.runtime.engine import Engine

INT8_LINEARS = {"q4x8_linear", "q8x8_linear", "q4kx8_linear", "q6kx8_linear", "q5x8_linear",
                "q5kx8_linear"}
needs_kernels = pytest.mark.skipif(K.qgemm_problem() is not None,
                                   reason=f"Flare's kernels: {K.qgemm_problem()}")


def test_non_temporal_only_on_amd_for_weights_larger_than_the_llc():
    mib, amd, intel = 1 << 20, "AuthenticAMD", "GenuineIntel"
    assert weight_prefetch.non_temporal(100 * mib, 32 * mib, amd)  # the Zen 4: cannot fit
    assert not weight_prefetch.non_temporal(100 * mib, 480 * mib, amd)
    assert not weight_prefetch.non_temporal(32 * mib, 32 * mib, amd)
    assert not weight_prefetch.non_temporal(100 * mib, None, amd)  # unknown LLC: T0
    # an Intel core keeps NTA lines in L1 alone: T0 whatever the sizes (the Xeon)
    assert not weight_prefetch.non_temporal(100 * mib, 480 * mib, intel)
    assert not weight_prefetch.non_temporal(800 * mib, 480 * mib, intel)
    assert not weight_prefetch.non_temporal(100 * mib, 32 * mib, None)


def test_the_vendor_is_cpuinfos_first_vendor_id(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\n"
                       "processor\t: 1\nvendor_id\t: AuthenticAMD\n")
    assert weight_prefetch.cpu_vendor(cpuinfo) == "AuthenticAMD"
    cpuinfo.write_text("processor\t: 0\nBogoMIPS\t: 50.00\n")  # an arm64 cpuinfo: none
    assert weight_prefetch.cpu_vendor(cpuinfo) is None
    assert weight_prefetch.cpu_vendor(tmp_path / "absent") is None


@pytest.mark.parametrize("text, size", [("491520K", 491520 << 10), ("32M", 32 << 20),
                                        ("1G", 1 << 30), ("4096", 4096), (" 48K\n", 48 << 10)])
def test_sysfs_cache_sizes(text, size):
    assert weight_prefetch.parse_cache_size(text) == size


@pytest.mark.parametrize("text", ["", "K", "12Q", "-1K", "1.5M"])
def test_a_size_sysfs_never_writes_is_refused(text):
    with pytest.raises(ValueError, match="not a cache size"):
        weight_prefetch.parse_cache_size(text)


def _cache(root, index, level, kind, size):
    folder = root / f"index{index}"
    folder.mkdir()
    (folder / "level").write_text(f"{level}\n")
    (folder / "type").write_text(f"{kind}\n")
    (folder / "size").write_text(f"{size}\n")


def test_the_llc_is_the_highest_level_data_or_unified_cache(tmp_path):
    _cache(tmp_path, 0, 1, "Data", "48K")
    _cache(tmp_path, 1, 1, "Instruction", "64K")
    _cache(tmp_path, 2, 2, "Unified", "2048K")
    _cache(tmp_path, 3, 3, "Unified", "491520K")
    assert weight_prefetch.last_level_cache_bytes(tmp_path) == 491520 << 10
    (tmp_path / "index3" / "size").write_text("garbled\n")  # unreadable: the next level down
    assert weight_prefetch.last_level_cache_bytes(tmp_path) == 2048 << 10


def test_no_cache_listed_is_none(tmp_path):
    assert weight_prefetch.last_level_cache_bytes(tmp_path) is None
    _cache(tmp_path, 0, 1, "Instruction", "32K")  # an instruction cache is never the LLC
    assert weight_prefetch.last_level_cache_bytes(tmp_path) is None


@needs_kernels
@pytest.mark.parametrize("rows", [1, 8, 17])
def test_every_int8_linear_gives_the_same_bytes_with_either_hint(rows):
    module = K.qgemm()
    before = module.weight_prefetch_nta()
    linears = [(name, call) for name, call in probe.problem(rows, seed=rows)
               if name.split(" ")[0] in INT8_LINEARS]
    assert {name.split(" ")[0] for name, _ in linears} == INT8_LINEARS
    try:
        for name, call in linears:
            module.set_weight_prefetch_nta(False)
            into_l1 = call(module)
            module.set_weight_prefetch_nta(True)
            assert module.weight_prefetch_nta()
            assert probe.same_bytes(call(module), into_l1), name
    finally:
        module.set_weight_prefetch_nta(before)


@needs_kernels
@pytest.mark.parametrize("vendor, llc_bytes, nta", [
    ("AuthenticAMD", None, False), ("AuthenticAMD", 1 << 40, False),
    ("AuthenticAMD", 1024, True), ("GenuineIntel", 1024, False)])
def test_native_layers_set_the_hint_for_their_weight_bytes(tiny_llama, monkeypatch, vendor,
                                                           llc_bytes, nta):
    """A 2-layer model's linears against an LLC that holds them, none known, and one of 1 KiB
    (another CPU's cpuinfo and sysfs, the only stand-in here: this machine is what it is)."""
    module = K.qgemm()
    before = module.weight_prefetch_nta()
    monkeypatch.setattr(weight_prefetch, "last_level_cache_bytes", lambda: llc_bytes)
    monkeypatch.setattr(weight_prefetch, "cpu_vendor", lambda: vendor)
    plan = make_plan(tiny_llama.config, max_seq_len=64, max_num_seqs=1, max_batch_tokens=16,
                     page_size=16)
    engine = Engine(tiny_llama.config, plan, convert_tensors(tiny_llama.tensors, "q4x8"),
                    tiny_llama.tokenizer)
    try:
        module.set_weight_prefetch_nta(not nta)  # the opposite, so the build must set it
        assert native_layers(engine.model) is not None
        assert module.weight_prefetch_nta() is nta
    finally:
        module.set_weight_prefetch_nta(before)


def test_a_linear_spec_counts_its_tensors_bias_and_parts():
    w, s, b = torch.zeros(8, 16, dtype=torch.uint8), torch.zeros(8, 1), torch.zeros(8)
    plain = ("q8x8", [w, s], 8, None, [])
    assert spec_bytes(plain) == 128 + 32
    assert spec_bytes(("q8x8", [w, s], 8, b, [])) == 128 + 32 + 32
    assert spec_bytes(("stacked", [], 16, None, [plain, plain])) == 2 * 160
    assert spec_bytes(None) == 0
