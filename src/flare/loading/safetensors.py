"""Read a Hugging Face folder (config.json, *.safetensors, tokenizer files) into a
`Checkpoint`, cast to the serving dtype. Sharded checkpoints are read through
`model.safetensors.index.json`."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from flare.loading.source import Checkpoint, check_tensor_names, source_identity
from flare.loading.tokenizer import load_tokenizer
from flare.models.config import ModelConfig
from flare.models.recipe import prepare_tensors, recipe_for
from flare.progress import progress_bar

INDEX_FILE = "model.safetensors.index.json"
# Buffers some older checkpoints saved that the recipe recomputes.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a folder: the shards named by the index when there is
    one, else every `*.safetensors`.

    Raises:
        FileNotFoundError: no weights, or a shard the index names is missing.
        ValueError: an unreadable index.
    """
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"{index}: unreadable safetensors index ({exc!r})") from None
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{folder}: shards named by {INDEX_FILE} are missing: "
                                    f"{missing}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors weights (pytorch_model.bin "
                                f"checkpoints are not supported)")
    return files


def load_safetensors_folder(folder: Path, dtype: torch.dtype = torch.float32,
                            progress: bool = False) -> Checkpoint:
    """Read a Hugging Face model folder (see `flare.loading.checkpoint.load_checkpoint`).

    Tensors keep their HF names, are cast to `dtype` and made contiguous. A tied model's
    "lm_head.weight", when saved anyway, is dropped (the head is the embedding).

    Raises:
        FileNotFoundError: missing folder, config.json, weights or tokenizer files (named).
        ValueError: unreadable config, quantized checkpoint, unsupported architecture,
            tensors that do not match the config.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"model folder {str(folder)!r} does not exist")
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{folder}: config.json is missing (expected a Hugging Face "
                                f"model folder)")
    try:
        hf_config = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{cfg_path}: unreadable JSON ({exc})") from None
    if "quantization_config" in hf_config:
        method = hf_config["quantization_config"].get("quant_method", "?")
        raise ValueError(f"{cfg_path}: quantized checkpoints ({method}) are not supported; "
                         f"use the unquantized weights or a GGUF")
    config = ModelConfig.from_hf(hf_config)
    recipe_for(config)

    files = weight_files(folder)
    tensors: dict[str, torch.Tensor] = {}
    with progress_bar(total=len(files), desc="loading", unit="file",
                      disable=not progress) as bar:
        for file in files:
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in f.keys():
                    if name.endswith(_IGNORED_SUFFIXES):
                        continue
                    if name == "lm_head.weight" and config.tie_word_embeddings:
                        continue
                    tensors[name] = f.get_tensor(name).to(dtype).contiguous()
            bar.update(1)
    tensors = prepare_tensors(config, tensors)  # the recipe's renames (Qwen3.5 folders)
    check_tensor_names(tensors, config, str(folder))
    tokenizer = load_tokenizer(folder)
    return Checkpoint(config=config, hf_config=hf_config, tensors=tensors,
                      tokenizer=tokenizer, source=source_identity(folder))
