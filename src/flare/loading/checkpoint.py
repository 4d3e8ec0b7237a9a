"""One entry point for reading a model: a GGUF file or a Hugging Face safetensors folder,
into Hugging Face tensor names, a config and a tokenizer (a `flare.loading.source.Checkpoint`)."""

from __future__ import annotations

from pathlib import Path

import torch

from flare.loading.gguf import load_gguf
from flare.loading.safetensors import load_safetensors_folder
from flare.loading.source import Checkpoint, checkpoint_format
from flare.models.recipe import recipe_for


def load_checkpoint(path: Path, dtype: torch.dtype = torch.float32,
                    progress: bool = False) -> Checkpoint:
    """Read a GGUF file or a Hugging Face safetensors folder.

    Args:
        path: a `.gguf` file, or a folder with config.json, *.safetensors (possibly
            sharded with model.safetensors.index.json) and tokenizer files. Folders of
            every recipe load (Llama/Qwen2/Qwen3, Qwen3.5 `Qwen3_5ForCausalLM` or its
            multimodal folder's text model, LFM2 `Lfm2ForCausalLM`); GGUF files of the
            dense family (llama, qwen2, qwen3) and of the hybrids in llama.cpp's
            naming (qwen35, lfm2: `flare.loading.gguf_hybrid`).
        dtype: dtype of every returned tensor (quantized GGUF tensors are dequantized
            to float32 first, then cast).
        progress: show a tqdm bar per tensor on stderr.

    Raises:
        FileNotFoundError: the path, or a file it needs, is missing (named).
        ValueError: unsupported format, architecture, tensor type, or tensors that do
            not match the config (named).
    """
    fmt = checkpoint_format(Path(path))
    if fmt == "gguf":
        ckpt = load_gguf(Path(path), dtype=dtype, progress=progress)
    else:
        ckpt = load_safetensors_folder(Path(path), dtype=dtype, progress=progress)
    recipe_for(ckpt.config)
    return ckpt
