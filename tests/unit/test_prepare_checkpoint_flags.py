"""`flare prepare --checkpoint-interval / --checkpoint-slots`: hybrid recipes get them in
their plan and memory report; a negative value, or a non-zero one for a KV-only recipe, is
one line on stderr naming it (exit 2) and nothing is written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flare.cli import main as flare_main


def test_hybrid_package_records_the_checkpoint_flags(tmp_path: Path, embedded_checkpoint):
    from hybrid_models import save_tiny_lfm2

    folder = tmp_path / "tiny-lfm2"
    save_tiny_lfm2(folder, embedded_checkpoint.tokenizer)
    out = tmp_path / "pkg"
    rc = flare_main(["prepare", str(folder), "--out", str(out), "--max-seq-len", "256",
                     "--max-num-seqs", "2", "--checkpoint-interval", "64",
                     "--checkpoint-slots", "3"])
    assert rc == 0
    manifest = json.loads((out / "manifest.json").read_text())
    plan, memory = manifest["plan"], manifest["memory"]
    assert (plan["checkpoint_interval"], plan["checkpoint_slots"], plan["state_slots"]) == (
        64, 3, 2)
    assert memory["state_slots"] == 2 + 3
    assert memory["state_pool_bytes"] == 5 * memory["state_bytes_per_slot"] > 0


def test_zero_checkpoint_slots_is_a_valid_hybrid_plan(tmp_path: Path, embedded_checkpoint):
    from flare.loading.checkpoint import load_checkpoint
    from flare.package.plan import make_plan
    from hybrid_models import save_tiny_qwen3_5

    folder = tmp_path / "tiny-qwen3_5"
    save_tiny_qwen3_5(folder, embedded_checkpoint.tokenizer)
    config = load_checkpoint(folder).config
    plan = make_plan(config, max_seq_len=256, max_num_seqs=2, checkpoint_slots=0,
                     checkpoint_interval=0)
    assert (plan.state_slots, plan.checkpoint_slots, plan.checkpoint_interval) == (2, 0, 0)
    default = make_plan(config, max_seq_len=256, max_num_seqs=2)
    assert (default.checkpoint_slots, default.checkpoint_interval) == (4, 256)


@pytest.mark.parametrize("flag", ["--checkpoint-interval", "--checkpoint-slots"])
@pytest.mark.parametrize("value", ["-1", "many"])
def test_a_bad_checkpoint_value_is_named_on_stderr(tmp_path: Path, capsys, flag, value):
    out = tmp_path / "pkg"
    with pytest.raises(SystemExit) as e:
        flare_main(["prepare", str(tmp_path / "model"), "--out", str(out), flag, value])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert flag in err and value in err and "integer >= 0" in err
    assert not out.exists()


@pytest.mark.parametrize("flag", ["--checkpoint-interval", "--checkpoint-slots"])
def test_checkpoint_flags_are_refused_for_a_kv_only_recipe(tmp_path: Path, capsys,
                                                            tiny_qwen3_dir, flag):
    out = tmp_path / "pkg"
    rc = flare_main(["prepare", str(tiny_qwen3_dir), "--out", str(out), "--max-seq-len",
                     "256", flag, "32"])
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    name = flag.removeprefix("--").replace("-", "_")
    assert err.startswith("flare prepare: error:")
    assert f"{name}=32" in err and "'llama'" in err and "hybrid recipes" in err
    assert not out.exists()


def test_zero_checkpoint_flags_are_accepted_for_a_kv_only_recipe(tmp_path: Path,
                                                                  tiny_qwen3_dir):
    out = tmp_path / "pkg"
    rc = flare_main(["prepare", str(tiny_qwen3_dir), "--out", str(out), "--max-seq-len", "256",
                     "--checkpoint-interval", "0", "--checkpoint-slots", "0"])
    assert rc == 0
    plan = json.loads((out / "manifest.json").read_text())["plan"]
    assert (plan["state_slots"], plan["checkpoint_slots"], plan["checkpoint_interval"]) == (
        0, 0, 0)


def test_an_unknown_plan_keyword_fails_before_anything_is_loaded(tmp_path: Path):
    """`prepare_package` passes its plan keywords on to `make_plan`: a misspelt one is a
    TypeError naming it before the (here missing) model is even looked at."""
    from flare.prepare.package import prepare_package

    with pytest.raises(TypeError, match=r"max_seqs_len.*make_plan takes max_seq_len, "):
        prepare_package(tmp_path / "no-such-model", tmp_path / "pkg", max_seqs_len=64)
    assert not (tmp_path / "pkg").exists()
