"""The runtime package contract: a prepared package passes its check; each way of breaking
it is refused with a message naming the expected and the found value; load_package and
ensure_package round-trip. Uses the tiny Qwen3 (fast) and, for the embedded model, the
session package."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flare.cli import main as cli_main
from flare.package.contract import (
    EXECUTION_ABI,
    MANIFEST_NAME,
    PREPARED_CONTRACT,
    PackageError,
    check_package,
    payload_id,
)
from flare.loading.checkpoint import load_checkpoint
from flare.models.quant.storage import convert_tensors
from flare.prepare.package import ensure_package, prepare_package
from flare.package.reader import load_package

SAMPLE = "Reverse a string: <|im_start|>user\ns[::-1] ünï 🙂<|im_end|>"


@pytest.fixture
def pkg(tiny_qwen3_package, tmp_path) -> Path:
    """A private copy of the tiny package, free to break."""
    out = tmp_path / "pkg"
    shutil.copytree(tiny_qwen3_package, out)
    return out


def edit_manifest(pkg: Path, **changes) -> None:
    m = json.loads((pkg / MANIFEST_NAME).read_text())
    m.update(changes)
    (pkg / MANIFEST_NAME).write_text(json.dumps(m))


def test_check_passes(tiny_qwen3_package):
    m = check_package(tiny_qwen3_package)
    assert m.execution_abi == EXECUTION_ABI and m.prepared_contract == PREPARED_CONTRACT
    assert m.package_id == payload_id(m.payload)
    assert m.device_class == "cpu"
    assert m.recipe == "llama" and m.recipe_version == 1
    assert m.model_name == "tiny-qwen3"
    assert m.dtype == "float32"
    assert m.source["format"] == "safetensors"
    assert m.config["model_type"] == "qwen3"
    assert m.plan["max_seq_len"] == 256 and m.plan["num_pages"] == 4 * 16
    assert m.memory["total_bytes"] <= m.memory["device_bytes"]
    # on CPU the serving process's own base is in the total (Python + torch: > 100 MiB)
    assert m.memory["runtime_bytes"] > 100 << 20
    assert m.memory["total_bytes"] == sum(m.memory[k] for k in (
        "weights_bytes", "kv_pool_bytes", "state_pool_bytes", "workspace_bytes",
        "host_tier_bytes", "runtime_bytes"))
    assert m.graph_capture["enabled"] is False and m.graph_capture["reason"]
    assert m.tuning["torch_num_threads"] >= 1
    assert {"model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(m.payload)
    # readable like the other package files (safetensors itself writes 0600)
    assert (tiny_qwen3_package / "model.safetensors").stat().st_mode & 0o777 == 0o644
    assert MANIFEST_NAME not in m.payload


def test_manifest_has_no_process_local_things(tiny_qwen3_package):
    text = (tiny_qwen3_package / MANIFEST_NAME).read_text().lower()
    for word in ("pointer", "data_ptr", "0x", "graph_handle", "stream", "slot_index"):
        assert word not in text, word


def test_abi_mismatch(pkg):
    edit_manifest(pkg, execution_abi=EXECUTION_ABI + 1)
    with pytest.raises(PackageError, match=rf"execution_abi mismatch.*expects {EXECUTION_ABI}"
                                           rf".*has {EXECUTION_ABI + 1}"):
        check_package(pkg)


def test_contract_mismatch(pkg):
    edit_manifest(pkg, prepared_contract=PREPARED_CONTRACT + 7)
    with pytest.raises(PackageError, match=rf"prepared_contract mismatch.*expects "
                                           rf"{PREPARED_CONTRACT}.*has {PREPARED_CONTRACT + 7}"):
        check_package(pkg)


def test_tampered_byte(pkg):
    path = pkg / "model.safetensors"
    expected = json.loads((pkg / MANIFEST_NAME).read_text())["payload"]["model.safetensors"]
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(PackageError, match="model.safetensors.*sha256 mismatch") as e:
        check_package(pkg)
    assert expected["sha256"] in str(e.value)


def test_truncated(pkg):
    path = pkg / "model.safetensors"
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size - 1000)
    with pytest.raises(PackageError, match=rf"model.safetensors.*size mismatch.*expected "
                                           rf"{size:,} bytes, found {size - 1000:,}"):
        check_package(pkg)


def test_missing_payload_file(pkg):
    (pkg / "tokenizer.json").unlink()
    with pytest.raises(PackageError, match="'tokenizer.json' missing"):
        check_package(pkg)


def test_missing_manifest(pkg):
    (pkg / MANIFEST_NAME).unlink()
    with pytest.raises(PackageError, match="expected manifest.json, found none"):
        check_package(pkg)


def test_invalid_manifest(pkg):
    (pkg / MANIFEST_NAME).write_text("{ not json")
    with pytest.raises(PackageError, match="unreadable"):
        check_package(pkg)
    edit = {"execution_abi": EXECUTION_ABI, "prepared_contract": PREPARED_CONTRACT}
    (pkg / MANIFEST_NAME).write_text(json.dumps(edit))
    with pytest.raises(PackageError, match="invalid manifest.json.*package_id"):
        check_package(pkg)


def test_package_id_mismatch(pkg):
    edit_manifest(pkg, package_id="0" * 64)
    with pytest.raises(PackageError, match=r"package_id mismatch.*0000"):
        check_package(pkg)


def test_cuda_package_on_cpu_machine(pkg):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    edit_manifest(pkg, device_class="cuda:9.0")
    with pytest.raises(PackageError, match=r"device class mismatch.*'cuda:9.0'.*\['cpu'\]"):
        check_package(pkg)
    with pytest.raises(PackageError, match=r"serving on 'cpu'.*prepared for 'cuda:9.0'"):
        load_package(pkg)


def test_recipe_version_mismatch(pkg):
    edit_manifest(pkg, recipe_version=99)
    with pytest.raises(PackageError, match="version mismatch.*has 1, the package has 99"):
        check_package(pkg)


def test_load_round_trip(tiny_qwen3_package, tiny_qwen3_dir):
    loaded = load_package(tiny_qwen3_package)
    # the package stores the weights in its weight format (fp16 by default on CPU)
    ref = convert_tensors(load_file(str(tiny_qwen3_dir / "model.safetensors")),
                          loaded.manifest.tuning["weights"])
    assert set(loaded.tensors) == set(ref)
    for k, v in ref.items():
        assert torch.equal(loaded.tensors[k], v), k
    assert loaded.config == load_checkpoint(tiny_qwen3_dir).config
    assert loaded.plan.max_seq_len == 256
    ref_tok = load_checkpoint(tiny_qwen3_dir).tokenizer
    assert loaded.tokenizer(SAMPLE).input_ids == ref_tok(SAMPLE).input_ids
    assert loaded.tokenizer.chat_template == ref_tok.chat_template


def test_smollm2_package_round_trip(smollm2_package, embedded_checkpoint):
    loaded = load_package(smollm2_package)
    m = loaded.manifest
    assert m.model_name == "SmolLM2-135M-Instruct"
    assert m.source["format"] == "gguf"
    assert m.plan["max_seq_len"] == 2048 and m.plan["page_size"] == 16
    assert loaded.config == embedded_checkpoint.config
    for k, v in convert_tensors(embedded_checkpoint.tensors, m.tuning["weights"]).items():
        assert torch.equal(loaded.tensors[k], v), k
    tok, ref = loaded.tokenizer, embedded_checkpoint.tokenizer
    assert tok(SAMPLE).input_ids == ref(SAMPLE).input_ids
    assert tok.chat_template == ref.chat_template
    msgs = [{"role": "user", "content": "hi"}]
    assert (tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            == ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True))
    assert tok.eos_token_id == 2 and tok.bos_token_id == 1


def test_prepare_bfloat16_and_name(tiny_qwen3_dir, tmp_path):
    m = prepare_package(tiny_qwen3_dir, tmp_path / "bf16", dtype="bfloat16", model_name="tiny",
                        max_seq_len=128, progress=False)
    assert m.dtype == "bfloat16" and m.model_name == "tiny" and m.plan["dtype"] == "bfloat16"
    loaded = load_package(tmp_path / "bf16")
    assert all(t.dtype == torch.bfloat16 for t in loaded.tensors.values())


def test_prepare_replaces_package_atomically(tiny_qwen3_dir, pkg):
    old_id = check_package(pkg).package_id
    m = prepare_package(tiny_qwen3_dir, pkg, max_seq_len=128, progress=False)
    assert m.package_id == old_id  # same payload, same id
    assert check_package(pkg).plan["max_seq_len"] == 128
    assert not [p for p in pkg.parent.iterdir() if p.name.startswith(".")]  # no leftovers


def test_prepare_refuses_foreign_folder(tiny_qwen3_dir, tmp_path):
    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="not a flare package"):
        prepare_package(tiny_qwen3_dir, other, progress=False)
    assert (other / "notes.txt").read_text() == "keep me"


def test_plan_that_does_not_fit(tiny_qwen3_dir, tmp_path):
    with pytest.raises(ValueError, match="plan does not fit"):
        prepare_package(tiny_qwen3_dir, tmp_path / "huge", max_seq_len=256,
                        num_pages=10**9, progress=False)
    assert not (tmp_path / "huge").exists()


def test_ensure_package_reuses_then_rebuilds(tiny_qwen3_dir, tmp_path):
    cache = tmp_path / "cache"
    first = ensure_package(tiny_qwen3_dir, cache, max_seq_len=256, progress=False)
    manifest_path = first / MANIFEST_NAME
    created = json.loads(manifest_path.read_text())["created_at"]
    mtime = manifest_path.stat().st_mtime_ns

    again = ensure_package(tiny_qwen3_dir, cache, max_seq_len=256, progress=False)
    assert again == first and manifest_path.stat().st_mtime_ns == mtime  # reused

    weights = first / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(PackageError):
        check_package(first)
    rebuilt = ensure_package(tiny_qwen3_dir, cache, max_seq_len=256, progress=False)
    assert rebuilt == first
    check_package(rebuilt)  # whole again
    assert manifest_path.stat().st_mtime_ns != mtime or json.loads(
        manifest_path.read_text())["created_at"] != created

    # a different plan is a different package
    ensure_package(tiny_qwen3_dir, cache, max_seq_len=128, progress=False)
    assert check_package(first).plan["max_seq_len"] == 128

    # an explicit weight format is a package of its own, beside the default one
    full = ensure_package(tiny_qwen3_dir, cache, max_seq_len=128, weights="full",
                          progress=False)
    assert full == first.parent / (first.name + "-full")
    assert check_package(full).tuning["weights"] == "full"
    assert check_package(first).tuning["weights"] == "fp16"  # untouched


# ---- the command line ---------------------------------------------------------------------

def test_cli_prepare(tiny_qwen3_dir, tmp_path, capsys):
    out = tmp_path / "cli-pkg"
    assert cli_main(["prepare", str(tiny_qwen3_dir), "--out", str(out), "--max-seq-len", "64",
                     "--name", "cli-tiny"]) == 0
    m = check_package(out)
    assert m.model_name == "cli-tiny" and m.plan["max_seq_len"] == 64
    assert m.package_id in capsys.readouterr().out


@pytest.mark.parametrize("argv,needle", [
    (["prepare", "x", "--out", "y", "--max-seq-len", "0"], "expected a positive integer, got 0"),
    (["prepare", "x", "--out", "y", "--page-size", "abc"], "'abc'"),
    (["prepare", "x", "--out", "y", "--dtype", "int3"], "'int3'"),
    (["serve", "pkg", "--port", "70000"], "70000"),
])
def test_cli_bad_values_one_line_exit_2(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1


def test_cli_errors_are_one_line(tiny_qwen3_dir, tmp_path, capsys):
    assert cli_main(["prepare", str(tmp_path / "absent"), "--out", str(tmp_path / "o")]) == 2
    assert cli_main(["prepare", str(tiny_qwen3_dir), "--out", str(tmp_path / "o"),
                     "--max-seq-len", "999999"]) == 2
    assert cli_main(["serve", str(tmp_path / "absent-pkg")]) == 2
    assert cli_main(["serve"]) == 2
    # progress goes to stderr too; errors are the lines that say so, one per failure
    lines = [ln for ln in capsys.readouterr().err.splitlines() if "error:" in ln]
    assert len(lines) == 4 and all(ln.startswith("flare ") for ln in lines)
    assert "absent" in lines[0] and "999999" in lines[1] and "absent-pkg" in lines[2]
    assert "PKG or --embedded" in lines[3]
