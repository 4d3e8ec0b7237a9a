"""Tiny GGUF files written for tests, and the checks every served GGUF gets.

The writers follow llama.cpp's converter where it matters to the loader: its tensor names,
its Llama q/k row permutation, its tokenizer keys. The tokenizer fields are either the
embedded model's (`tokenizer_fields_of`) or a tiny vocabulary built by the test, under the
same GGUF keys.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from engine_helpers import words
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize
from hf_reference import greedy_logit_diffs, hf_model, round_linear_inputs_to_int8

from flare.kernels import cpu_problem
from flare.loading.checkpoint import load_checkpoint
from flare.loading.gguf import open_gguf
from flare.models.quant.formats import default_kv_dtype, default_weight_format
from flare.models.quant.storage import convert_tensors, weight_getter
from flare.package.plan import make_plan
from flare.runtime.engine import Engine

T = GGMLQuantizationType
needs_kernel = pytest.mark.skipif(cpu_problem() is not None, reason=str(cpu_problem()))
TOKENIZER_KEYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                  "tokenizer.ggml.merges", "tokenizer.ggml.pre", "tokenizer.chat_template")

# Hugging Face module (within a layer) -> llama.cpp's block tensor name
LLAMA_BLOCK = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
LLAMA_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight",
                "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}


def llama_gguf_name(hf: str) -> str:
    """llama.cpp's name for a Hugging Face Llama / Qwen2 / Qwen3 tensor name."""
    if hf in LLAMA_GLOBAL:
        return LLAMA_GLOBAL[hf]
    _, _, layer, rest = hf.split(".", 3)
    module, suffix = rest.rsplit(".", 1)
    return f"blk.{layer}.{LLAMA_BLOCK[module]}.{suffix}"


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.LlamaModel.permute, as llama.cpp writes q_proj / k_proj."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def tokenizer_fields_of(path: Path) -> dict:
    """A GGUF's tokenizer fields (`TOKENIZER_KEYS` -> value), to write into another."""
    r = open_gguf(path)
    return {k: r.fields[k].contents() for k in TOKENIZER_KEYS}


def add_shape(w: GGUFWriter, name: str, cfg) -> None:
    """The metadata every tiny file opens with: its `name` and the transformers config's
    context length, width, depth, FFN width and head count."""
    w.add_name(name)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)


def add_tokenizer(w: GGUFWriter, tok: dict) -> None:
    """A byte-level BPE tokenizer from `tok` (`TOKENIZER_KEYS`), bos 1 and eos 2."""
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(tok["tokenizer.ggml.pre"])
    w.add_token_list(tok["tokenizer.ggml.tokens"])
    w.add_token_types(tok["tokenizer.ggml.token_type"])
    w.add_token_merges(tok["tokenizer.ggml.merges"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(tok["tokenizer.chat_template"])


def close_gguf(w: GGUFWriter) -> None:
    """Write the header, metadata and tensors, and close the file."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def encode(a: np.ndarray, kind: str) -> np.ndarray:
    """`a` as the bytes of GGUF type `kind` (gguf's own quantizer; float16 cast for F16)."""
    if kind == "F16":
        return a.astype(np.float16)
    return quantize(a, T[kind])


def write_llama_gguf(path: Path, tok: dict, *, hidden: int, ffn: int, tied: bool,
                     kind_of: Callable[[str], str], title: str = "tiny llama",
                     encoder: Callable[[np.ndarray, str], np.ndarray] = encode,
                     seed: int = 3) -> None:
    """A random 2-layer Llama (4 heads, 2 KV heads, the vocabulary of `tok`) as a GGUF:
    every 1-D tensor F32, each 2-D one of type `kind_of(hf name)` encoded by `encoder`
    (F32 as it is); no output layer when `tied`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2,
                      vocab_size=len(tok["tokenizer.ggml.tokens"]),
                      max_position_embeddings=1024, rms_norm_eps=1e-5,
                      tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(cfg)
    w = GGUFWriter(str(path), "llama")
    add_shape(w, title, cfg)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    add_tokenizer(w, tok)
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and tied:
            continue
        a = t.numpy()
        if ".q_proj." in name:
            a = llamacpp_permute(a, 4)
        elif ".k_proj." in name:
            a = llamacpp_permute(a, 2)
        kind = "F32" if a.ndim == 1 else kind_of(name)
        a = np.ascontiguousarray(a)
        if kind == "F32":
            w.add_tensor(llama_gguf_name(name), a)
        elif kind == "F16":
            w.add_tensor(llama_gguf_name(name), encoder(a, kind))
        else:
            q = encoder(a, kind)
            w.add_tensor(llama_gguf_name(name), q, raw_shape=q.shape, raw_dtype=T[kind])
    close_gguf(w)


def engine_maker(ckpt, fmt: str):
    """(make(max_batch_tokens, max_num_seqs) -> Engine, stored tensors): engines over the
    checkpoint converted once to format `fmt` from its own blocks, 256 positions, pages
    of 16."""
    stored = convert_tensors(ckpt.tensors, fmt, ckpt.blocks)

    def make(max_batch_tokens: int, max_num_seqs: int) -> Engine:
        plan = make_plan(ckpt.config, max_seq_len=256, max_num_seqs=max_num_seqs,
                         max_batch_tokens=max_batch_tokens, page_size=16)
        return Engine(ckpt.config, plan, stored, ckpt.tokenizer)

    return make, stored


def check_prepare_serves_the_files_blocks(path: Path, fmt: str, out: Path) -> None:
    """`flare prepare` of the GGUF at `path` with defaults, into `out`: the weight format
    is `fmt`, the package holds the file's blocks as `convert_tensors` builds them, the
    memory report's weight bytes are what `serving_weight_bytes` counts, and the package
    serves the same greedy tokens as an engine over the converted tensors."""
    from engine_helpers import greedy, run

    from flare.models.quant.sizes import serving_weight_bytes
    from flare.package.reader import load_package
    from flare.prepare.package import prepare_package

    m = prepare_package(path, out, max_seq_len=128, progress=False)
    assert m.tuning["weights"] == fmt
    ckpt = load_checkpoint(path)
    stored = convert_tensors(ckpt.tensors, fmt, ckpt.blocks)
    assert m.memory["weights_bytes"] == serving_weight_bytes(
        stored, fmt, ckpt.config.tie_word_embeddings)
    pkg = load_package(out)
    for k, v in stored.items():
        assert torch.equal(pkg.tensors[k], v), k
    ids = words(20, seed=4)
    # the pool dtype prepare gives the format (float16 for the int8 formats)
    plan = make_plan(ckpt.config, max_seq_len=128, max_num_seqs=8,
                     kv_dtype=default_kv_dtype(fmt, dtype="float32", device="cpu"))
    assert run(Engine.from_package(pkg), ids, greedy(8))[0] == run(
        Engine(ckpt.config, plan, stored, ckpt.tokenizer), ids, greedy(8))[0]


def served_gguf_fixtures(files: dict, write: Callable[[Path, tuple, dict], None]):
    """Module-scoped fixtures `gguf_file` ((name, path), one file a key of `files`,
    written by `write(path, files[name], the embedded model's tokenizer fields)`) and
    `loaded` ((name, its `Checkpoint`)); assign them to those names in a test module."""
    @pytest.fixture(scope="module", params=list(files))
    def gguf_file(request, tmp_path_factory, embedded_gguf):
        path = tmp_path_factory.mktemp("gguf") / f"tiny-{request.param}.gguf"
        write(path, files[request.param], tokenizer_fields_of(embedded_gguf))
        return request.param, path

    @pytest.fixture(scope="module")
    def loaded(gguf_file):
        name, path = gguf_file
        return name, load_checkpoint(path)

    return gguf_file, loaded


def check_exact(ckpt, fmt: str) -> None:
    """The engine's exactness checks (`exactness`: chunkings, batch neighbours) on a
    40-token prompt, the checkpoint served in format `fmt`."""
    from exactness import check_batch_neighbours, check_chunkings

    make, _ = engine_maker(ckpt, fmt)
    prompt = words(40, seed=9)
    check_chunkings(make, prompt, 5)
    check_batch_neighbours(make, prompt, 5)


def greedy_diffs_on_the_files_values(ckpt, fmt: str, label: str,
                                     near_tie: float = 0.0) -> list[float]:
    """Greedy tokens (12, after prompts of 3, 17 and 40 tokens) of the checkpoint served
    in format `fmt` asserted equal to transformers' on its dequantized values, each
    linear layer's input rounded to int8 blocks as Flare's kernels round it (all but an
    output layer served as floats), up to near-ties after a rounding step where
    `near_tie` > 0; returns each prompt's last-position logits max abs difference
    (`hf_reference.greedy_logit_diffs`)."""
    make, stored = engine_maker(ckpt, fmt)
    model = hf_model(ckpt.config, ckpt.tensors)
    head = "lm_head.weight" if "lm_head.weight" in ckpt.tensors else "model.embed_tokens.weight"
    float_head = isinstance(weight_getter(stored)(head), torch.Tensor)
    round_linear_inputs_to_int8(model, skip={"lm_head"} if float_head else ())
    engine = make(max_batch_tokens=64, max_num_seqs=4)
    prompts = [words(n, seed=20 + n) for n in (3, 17, 40)]
    diffs = greedy_logit_diffs(engine, model, prompts, 12, label, near_tie)
    engine.check_integrity()
    return diffs


class ServedGGUFChecks:
    """The checks every tiny GGUF served in its own blocks gets, over the test module's
    `gguf_file` and `loaded` fixtures (`served_gguf_fixtures`). A module subclasses it as
    `Test...` and sets:

    Attributes:
        files: the module's files, name -> spec whose last item is the default format.
        max_diff: the bound on each prompt's last-position logits difference against
            transformers.
        exact_prompts: how many of the 3 prompts stay within summation order (under
            1e-5); the others met an int8 rounding midpoint.
        near_tie: where a rounding step has moved a prompt's logits, its tokens may part
            from transformers' at a near-tie within this (0: never).
    """

    files: dict
    max_diff: float
    exact_prompts: int = 2
    near_tie: float = 0.0

    @needs_kernel
    def test_default_format_is_the_files_own(self, loaded):
        name, ckpt = loaded
        assert default_weight_format(dtype="float32", device="cpu", recipe="llama",
                                     source=ckpt.source) == self.files[name][-1]

    @needs_kernel
    def test_exact_in_the_default_format(self, loaded):
        name, ckpt = loaded
        check_exact(ckpt, self.files[name][-1])

    @needs_kernel
    def test_greedy_tokens_equal_transformers_on_the_files_values(self, loaded):
        """transformers on the dequantized file values, every linear layer that Flare
        feeds int8 activations (all but a float output layer) seeing its input rounded
        to int8 blocks as Flare's kernels round it: the same greedy tokens, last-position
        logits within summation order (one int8 rounding step where an activation sits
        at a midpoint)."""
        name, ckpt = loaded
        diffs = greedy_diffs_on_the_files_values(ckpt, self.files[name][-1], name,
                                                 self.near_tie)
        assert sorted(diffs)[self.exact_prompts - 1] < 1e-5, diffs
        assert max(diffs) < self.max_diff, diffs

    @needs_kernel
    def test_prepare_serves_the_files_blocks(self, gguf_file, tmp_path):
        """`flare prepare` with defaults: the file's format, its blocks in the package, the
        memory report's weight bytes as `serving_weight_bytes` counts them, served tokens
        equal to an engine over the converted tensors."""
        name, path = gguf_file
        check_prepare_serves_the_files_blocks(path, self.files[name][-1], tmp_path / "pkg")
