"""GGUF loading: the embedded model against transformers' own GGUF loader, and tiny GGUFs
written here from known Hugging Face tensors (llama permuted as llama.cpp does, qwen2 with
biases, qwen3 with q/k norms) read back exactly."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFWriter
from gguf_files import (
    add_shape,
    add_tokenizer,
    close_gguf,
    llama_gguf_name,
    llamacpp_permute,
)

from flare.loading.checkpoint import load_checkpoint
from flare.loading.gguf import hf_tensor_name, open_gguf, unpermute_qk

SAMPLE = ("Hello world! <|im_start|>user\nReverse a string in Python: def f(s): "
          "return s[::-1]  \t ünïcödé 🙂 1234567<|im_end|>\n")


# ---- the embedded model -------------------------------------------------------------------

def test_config_matches_facts(embedded_checkpoint):
    c = embedded_checkpoint.config
    assert c.architecture == "LlamaForCausalLM" and c.model_type == "llama"
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads,
            c.num_key_value_heads, c.head_dim) == (30, 576, 9, 3, 64)
    assert c.intermediate_size == 1536
    assert c.vocab_size == 49152
    assert c.rope_theta == 100000.0
    assert c.max_position_embeddings == 8192
    assert c.rms_norm_eps == 1e-5
    assert c.tie_word_embeddings is True
    assert c.bos_token_id == 1 and c.eos_token_ids == (2,)
    assert not c.attention_bias and not c.qk_norm


def test_tensors_shapes_dtypes(embedded_checkpoint):
    t = embedded_checkpoint.tensors
    assert len(t) == 272  # 30 x 9 + embedding + final norm; tied: no lm_head
    assert "lm_head.weight" not in t
    assert t["model.embed_tokens.weight"].shape == (49152, 576)
    assert t["model.layers.0.self_attn.q_proj.weight"].shape == (576, 576)
    assert t["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert t["model.layers.29.mlp.down_proj.weight"].shape == (576, 1536)
    assert all(v.dtype == torch.float32 and v.is_contiguous() for v in t.values())


def test_source_identity(embedded_checkpoint, embedded_gguf):
    src = embedded_checkpoint.source
    assert src["format"] == "gguf"
    assert src["name"] == "SmolLM2-135M-Instruct"
    entry = src["files"][embedded_gguf.name]
    assert entry["bytes"] == embedded_gguf.stat().st_size == 98_362_432
    assert entry["sha256"] == hashlib.sha256(embedded_gguf.read_bytes()).hexdigest()


@pytest.mark.slow
def test_tensors_equal_transformers_gguf_loader(embedded_checkpoint, embedded_gguf):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(embedded_gguf.parent), gguf_file=embedded_gguf.name, local_files_only=True)
    ref = model.state_dict()
    ours = embedded_checkpoint.tensors
    # transformers lists the tied head separately; it is the embedding
    assert set(ref) - set(ours) == {"lm_head.weight"}
    assert torch.equal(ref["lm_head.weight"], ours["model.embed_tokens.weight"])
    assert set(ours) <= set(ref)
    worst = max((ref[k].float() - v).abs().max().item() for k, v in ours.items())
    assert worst == 0.0
    for k, v in ours.items():
        assert ref[k].shape == v.shape, k


def test_tokenizer_equals_transformers_gguf_tokenizer(embedded_checkpoint, embedded_gguf):
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(str(embedded_gguf.parent), gguf_file=embedded_gguf.name,
                                        local_files_only=True)
    ours = embedded_checkpoint.tokenizer
    assert ours(SAMPLE).input_ids == ref(SAMPLE).input_ids
    assert ours.bos_token_id == 1 and ours.eos_token_id == 2
    assert ours.decode(ours(SAMPLE).input_ids) == SAMPLE


def test_chat_template_from_gguf_metadata(embedded_checkpoint, embedded_gguf):
    reader = open_gguf(embedded_gguf)
    meta = reader.fields["tokenizer.chat_template"].contents()
    tok = embedded_checkpoint.tokenizer
    assert tok.chat_template == meta
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert "You are a helpful AI assistant named SmolLM" in text


# ---- name map and permutation -------------------------------------------------------------

def test_hf_tensor_names():
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("output_norm.weight") == "model.norm.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    assert hf_tensor_name("blk.7.attn_q.bias") == "model.layers.7.self_attn.q_proj.bias"
    assert hf_tensor_name("blk.0.attn_output.weight") == "model.layers.0.self_attn.o_proj.weight"
    assert hf_tensor_name("blk.3.attn_k_norm.weight") == "model.layers.3.self_attn.k_norm.weight"
    assert hf_tensor_name("blk.2.ffn_norm.weight") == "model.layers.2.post_attention_layernorm.weight"
    assert hf_tensor_name("blk.2.ffn_gate_exps.weight") is None
    assert hf_tensor_name("rope_freqs.weight") is None


@pytest.mark.parametrize("n_head,head_dim,cols", [(9, 64, 576), (3, 64, 576), (4, 16, 0)])
def test_unpermute_inverts_llamacpp(n_head, head_dim, cols):
    shape = (n_head * head_dim, cols) if cols else (n_head * head_dim,)
    w = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    permuted = torch.from_numpy(llamacpp_permute(w, n_head).copy())
    assert not torch.equal(permuted, torch.from_numpy(w))
    assert torch.equal(unpermute_qk(permuted, n_head), torch.from_numpy(w))


# ---- tiny GGUFs written from known HF tensors ---------------------------------------------

TINY_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "{% endif %}")


def byte_chars() -> list[str]:
    """GPT-2's printable stand-in for each byte (bytes_to_unicode), in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


@pytest.fixture(scope="module")
def tokenizer_fields():
    """A tiny byte-level BPE vocabulary: 3 specials (ids 0-2), 256 bytes, a few merges.
    Small so that tiny GGUFs load in well under a second."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a"]
    merged = [m.replace(" ", "") for m in merges]
    tokens = specials + byte_chars() + merged
    types = [3] * len(specials) + [1] * (len(tokens) - len(specials))
    return {"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": merges,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.pre": "gpt2",
            "tokenizer.chat_template": TINY_TEMPLATE}


VOCAB = 3 + 256 + 5


def tiny_hf_model(arch: str, tied: bool):
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                  max_position_embeddings=1024, rms_norm_eps=1e-6, tie_word_embeddings=tied,
                  bos_token_id=1, eos_token_id=2)
    cfg = {"llama": lambda: LlamaConfig(**common, rope_theta=10000.0),
           "qwen2": lambda: Qwen2Config(**common, rope_theta=1e6),
           "qwen3": lambda: Qwen3Config(**common, head_dim=32, rope_theta=1e6)}[arch]()
    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # random norms and biases, so a swapped one would show
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", ".bias")):
                p.uniform_(-1.5, 1.5)
    return model


def write_tiny_gguf(path: Path, arch: str, model, tok: dict) -> None:
    cfg = model.config
    w = GGUFWriter(str(path), arch)
    add_shape(w, f"tiny {arch}", cfg)
    w.add_head_count_kv(cfg.num_key_value_heads)
    if arch == "qwen3":
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    add_tokenizer(w, tok)
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        a = t.numpy()
        if arch == "llama" and ".q_proj." in name:
            a = llamacpp_permute(a, cfg.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            a = llamacpp_permute(a, cfg.num_key_value_heads)
        w.add_tensor(llama_gguf_name(name), np.ascontiguousarray(a))
    close_gguf(w)


@pytest.mark.parametrize("arch,tied", [("llama", True), ("qwen2", False), ("qwen3", False)])
def test_tiny_gguf_round_trip(tmp_path, tokenizer_fields, arch, tied):
    model = tiny_hf_model(arch, tied)
    path = tmp_path / f"tiny-{arch}.F32.gguf"
    write_tiny_gguf(path, arch, model, tokenizer_fields)

    ckpt = load_checkpoint(path)
    ref = {k: v for k, v in model.state_dict().items()
           if not (tied and k == "lm_head.weight")}
    assert set(ckpt.tensors) == set(ref)
    for k, v in ref.items():
        assert torch.equal(ckpt.tensors[k], v), k
    c = ckpt.config
    assert c.model_type == arch and c.tie_word_embeddings is tied
    assert c.attention_bias is (arch == "qwen2")
    assert c.qk_norm is (arch == "qwen3")
    assert c.head_dim == (32 if arch == "qwen3" else 16)
    assert c.rope_theta == model.config.rope_parameters["rope_theta"]
    assert c.rms_norm_eps == 1e-6
    assert ckpt.source["name"] == f"tiny-{arch}"
    tok = ckpt.tokenizer
    assert tok.chat_template == TINY_TEMPLATE
    ids = tok(" the cat in a hat").input_ids
    assert tok.convert_ids_to_tokens(ids)[0] == "Ġthe"
    assert tok.decode(ids) == " the cat in a hat"
    assert tok("<|im_end|>").input_ids == [2]


def test_tiny_gguf_bf16(tmp_path, tokenizer_fields):
    model = tiny_hf_model("qwen3", tied=False)
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, "qwen3", model, tokenizer_fields)
    ckpt = load_checkpoint(path, dtype=torch.bfloat16)
    for k, v in model.state_dict().items():
        assert ckpt.tensors[k].dtype == torch.bfloat16
        assert torch.equal(ckpt.tensors[k], v.to(torch.bfloat16)), k


# ---- errors ------------------------------------------------------------------------------

def test_not_a_gguf(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"definitely not gguf")
    with pytest.raises(ValueError, match="bad.gguf.*not a readable GGUF"):
        load_checkpoint(bad)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing.gguf"):
        load_checkpoint(tmp_path / "nothing.gguf")


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "gpt2.gguf"
    w = GGUFWriter(str(path), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    close_gguf(w)
    with pytest.raises(ValueError, match="architecture 'gpt2' is not supported"):
        load_checkpoint(path)
