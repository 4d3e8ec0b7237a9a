"""What a model read into memory is, whichever file it came from: the `Checkpoint` type,
its source identity, and the checks every reader shares. The readers (`flare.loading.gguf`,
`flare.loading.safetensors`) build a `Checkpoint`; `flare.loading.checkpoint` picks one."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from flare.loading.tokenizer import TOKENIZER_FILES
from flare.models.config import ModelConfig
from flare.package.contract import file_entry

# Files of a Hugging Face folder that decide the model's behaviour (beside the weights);
# their hashes make up the source identity.
FOLDER_META_FILES = ("config.json", "generation_config.json", "model.safetensors.index.json",
                     *TOKENIZER_FILES)
# A quantization tag at the end of a GGUF file stem: "SmolLM2-135M-Instruct.Q4_1".
_QUANT_SUFFIX = re.compile(r"[.\-_](I?Q\d\w*|F16|F32|BF16)$", re.IGNORECASE)


@dataclass
class Checkpoint:
    """A model read into memory.

    Attributes:
        config: the hyper-parameters the recipe reads.
        hf_config: the transformers `config.json` dict it came from (built from metadata
            for GGUF); loadable with `transformers.AutoConfig.for_model(**hf_config)`.
        tensors: Hugging Face name -> contiguous CPU tensor of the requested dtype, in
            Hugging Face layout ([out_features, in_features] for projections). Tied
            models have no "lm_head.weight": the head is "model.embed_tokens.weight".
        tokenizer: a transformers tokenizer with `chat_template` set.
        source: identity of what was read: {"format": "gguf" | "safetensors",
            "path": file or folder base name, "name": default model name,
            "files": {name: {"sha256", "bytes"}}, ...format-specific keys}.
        blocks: for a GGUF, each 2-D weight's GGUF type and, for the block types served
            as stored (Q4_0, Q4_1, Q8_0), the file's own block bytes in Hugging Face row
            order (`flare.models.quant.gguf_blocks.GGUFBlocks`); empty for a safetensors folder.
            `flare.models.quant.storage.convert_tensors` builds the quantized formats from them.
    """

    config: ModelConfig
    hf_config: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    tokenizer: PreTrainedTokenizerBase
    source: dict[str, Any]
    blocks: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        """Default model name (GGUF file stem without the quant tag, or folder name)."""
        return self.source["name"]

    @property
    def weights_bytes(self) -> int:
        """Bytes of all tensors at their dtype."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def checkpoint_format(path: Path) -> str:
    """"gguf" for a `.gguf` file, "safetensors" for a folder.

    Raises:
        FileNotFoundError: nothing at `path`.
        ValueError: a file that is not `.gguf` (e.g. a lone .safetensors without its folder).
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"model path {str(path)!r} does not exist")
    if path.is_dir():
        return "safetensors"
    if path.suffix.lower() == ".gguf":
        return "gguf"
    raise ValueError(
        f"model path {str(path)!r}: expected a .gguf file or a Hugging Face folder "
        f"(config.json + *.safetensors), found a {path.suffix or 'suffix-less'} file"
    )


def default_model_name(path: Path) -> str:
    """"SmolLM2-135M-Instruct" for ".../SmolLM2-135M-Instruct.Q4_1.gguf"; a folder's name."""
    path = Path(path)
    if path.is_dir():
        return path.resolve().name
    return _QUANT_SUFFIX.sub("", path.stem) or path.stem


def source_identity(path: Path) -> dict[str, Any]:
    """Identity of a checkpoint without loading it: format, base name, default name and
    the sha256 and size of each file that decides its behaviour (the GGUF file; or config,
    weights, index and tokenizer files of a folder). About 1 s per GB hashed.

    Raises:
        FileNotFoundError / ValueError: as `checkpoint_format`.
    """
    path = Path(path)
    fmt = checkpoint_format(path)
    if fmt == "gguf":
        files = {path.name: file_entry(path)}
    else:
        names = [n for n in FOLDER_META_FILES if (path / n).is_file()]
        names += sorted(p.name for p in path.glob("*.safetensors"))
        files = {n: file_entry(path / n) for n in sorted(set(names))}
    return {"format": fmt, "path": path.resolve().name, "name": default_model_name(path),
            "files": files}


def expected_tensor_names(config: ModelConfig) -> set[str]:
    """Hugging Face tensor names a model of `config` must have, per the recipe that runs it
    (dense Llama family, Qwen3.5 text model, LFM2)."""
    from flare.models.recipe import expected_tensor_names as by_recipe

    return by_recipe(config)


def check_tensor_names(tensors: dict[str, torch.Tensor], config: ModelConfig, where: str) -> None:
    """Raise ValueError naming missing and unexpected tensors (at most 5 of each)."""
    from flare.models.recipe import recipe_for

    expected = expected_tensor_names(config)
    missing = sorted(expected - tensors.keys())
    extra = sorted(tensors.keys() - expected)
    if missing or extra:
        raise ValueError(
            f"{where}: tensors do not match a {config.architecture} with "
            f"{config.num_hidden_layers} layers (recipe {recipe_for(config)}): missing {missing[:5]}"
            f"{' ...' if len(missing) > 5 else ''}, unexpected {extra[:5]}"
            f"{' ...' if len(extra) > 5 else ''}"
        )
