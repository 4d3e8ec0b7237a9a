"""Hugging Face folder loading: a tiny random Qwen3 saved by transformers reads back exactly,
single-file and sharded, in fp32 and bf16, with its tokenizer; bad folders are named."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flare.loading.checkpoint import load_checkpoint

SAMPLE = "Hello <|im_start|>user\nwrite code: s[::-1] ünï 🙂<|im_end|>"


def reference_tensors(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


def test_tensors_and_config(tiny_qwen3_dir):
    ckpt = load_checkpoint(tiny_qwen3_dir)
    ref = reference_tensors(tiny_qwen3_dir)
    assert set(ckpt.tensors) == set(ref)
    assert "lm_head.weight" in ckpt.tensors  # untied
    for k, v in ref.items():
        assert torch.equal(ckpt.tensors[k], v), k
        assert ckpt.tensors[k].is_contiguous()
    c = ckpt.config
    assert (c.architecture, c.model_type) == ("Qwen3ForCausalLM", "qwen3")
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
            c.head_dim, c.vocab_size) == (2, 64, 4, 2, 16, 49152)
    assert c.qk_norm and not c.tie_word_embeddings
    assert c.rope_theta == 1_000_000.0
    assert ckpt.hf_config == json.loads((tiny_qwen3_dir / "config.json").read_text())


def test_source_identity(tiny_qwen3_dir):
    src = load_checkpoint(tiny_qwen3_dir).source
    assert src["format"] == "safetensors"
    assert src["name"] == src["path"] == "tiny-qwen3"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(src["files"])
    entry = src["files"]["model.safetensors"]
    assert entry["bytes"] == (tiny_qwen3_dir / "model.safetensors").stat().st_size
    assert len(entry["sha256"]) == 64


def test_tokenizer_same_ids_and_template(tiny_qwen3_dir, embedded_checkpoint):
    ours = load_checkpoint(tiny_qwen3_dir).tokenizer
    ref = embedded_checkpoint.tokenizer
    assert ours(SAMPLE).input_ids == ref(SAMPLE).input_ids
    assert ours.chat_template == ref.chat_template


def test_bfloat16_cast(tiny_qwen3_dir):
    ckpt = load_checkpoint(tiny_qwen3_dir, dtype=torch.bfloat16)
    for k, v in reference_tensors(tiny_qwen3_dir).items():
        assert ckpt.tensors[k].dtype == torch.bfloat16
        assert torch.equal(ckpt.tensors[k], v.to(torch.bfloat16)), k


def test_sharded(tmp_path, embedded_checkpoint, make_tiny_qwen3):
    folder = tmp_path / "sharded"
    model = make_tiny_qwen3(folder, embedded_checkpoint.tokenizer, max_shard_size="8MB")
    assert (folder / "model.safetensors.index.json").is_file()
    assert len(list(folder.glob("*.safetensors"))) > 1
    ckpt = load_checkpoint(folder)
    ref = model.state_dict()
    assert set(ckpt.tensors) == set(ref)
    for k, v in ref.items():
        assert torch.equal(ckpt.tensors[k], v), k
    assert "model.safetensors.index.json" in ckpt.source["files"]


def test_tied_has_no_lm_head(tmp_path, embedded_checkpoint, make_tiny_qwen3):
    folder = tmp_path / "tied"
    make_tiny_qwen3(folder, embedded_checkpoint.tokenizer, tie_word_embeddings=True)
    ckpt = load_checkpoint(folder)
    assert ckpt.config.tie_word_embeddings
    assert "lm_head.weight" not in ckpt.tensors


# ---- errors name what is missing --------------------------------------------------------

def copy_of(folder: Path, tmp_path: Path) -> Path:
    out = tmp_path / folder.name
    shutil.copytree(folder, out)
    return out


def test_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        load_checkpoint(tmp_path / "nope")


def test_missing_config(tiny_qwen3_dir, tmp_path):
    folder = copy_of(tiny_qwen3_dir, tmp_path)
    (folder / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json is missing"):
        load_checkpoint(folder)


def test_missing_weights(tiny_qwen3_dir, tmp_path):
    folder = copy_of(tiny_qwen3_dir, tmp_path)
    (folder / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors"):
        load_checkpoint(folder)


def test_missing_shard(tmp_path, embedded_checkpoint, make_tiny_qwen3):
    folder = tmp_path / "sharded"
    make_tiny_qwen3(folder, embedded_checkpoint.tokenizer, max_shard_size="8MB")
    victim = sorted(folder.glob("*.safetensors"))[0]
    victim.unlink()
    with pytest.raises(FileNotFoundError, match=victim.name):
        load_checkpoint(folder)


def test_missing_tokenizer(tiny_qwen3_dir, tmp_path):
    folder = copy_of(tiny_qwen3_dir, tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (folder / name).unlink(missing_ok=True)
    with pytest.raises(FileNotFoundError, match="no tokenizer files"):
        load_checkpoint(folder)


def test_missing_chat_template(tiny_qwen3_dir, tmp_path):
    folder = copy_of(tiny_qwen3_dir, tmp_path)
    (folder / "chat_template.jinja").unlink()
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="no chat template"):
        load_checkpoint(folder)


def test_missing_tensor(tiny_qwen3_dir, tmp_path):
    from safetensors.torch import save_file

    folder = copy_of(tiny_qwen3_dir, tmp_path)
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="missing.*layers.1.self_attn.k_norm"):
        load_checkpoint(folder)


def test_unsupported_architecture(tiny_qwen3_dir, tmp_path):
    folder = copy_of(tiny_qwen3_dir, tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"] = ["MambaForCausalLM"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="MambaForCausalLM"):
        load_checkpoint(folder)


def test_lone_file_refused(tiny_qwen3_dir):
    with pytest.raises(ValueError, match="expected a .gguf file or a Hugging Face folder"):
        load_checkpoint(tiny_qwen3_dir / "model.safetensors")
