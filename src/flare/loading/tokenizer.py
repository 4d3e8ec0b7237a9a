"""Load a tokenizer with transformers from local files only, and make sure it has a chat
template (a chat server cannot format a conversation without one)."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

# Files transformers may read for a tokenizer; a folder with none of them has no tokenizer.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)


def load_tokenizer(
    folder: Path, gguf_file: str | None = None, chat_template: str | None = None
) -> PreTrainedTokenizerBase:
    """Load the tokenizer of a Hugging Face folder, or of a GGUF file inside `folder`.

    Args:
        folder: a local folder (never a hub id: nothing is downloaded).
        gguf_file: file name of a GGUF in `folder`; its `tokenizer.ggml.*` metadata is
            converted by transformers.
        chat_template: used when the loaded tokenizer has none (e.g. the GGUF's
            `tokenizer.chat_template`, read by the caller).

    Returns:
        A transformers tokenizer whose `chat_template` is set.

    Raises:
        FileNotFoundError: no tokenizer files in `folder`, naming it.
        ValueError: transformers cannot build a tokenizer from the files, or no chat
            template anywhere.
    """
    folder = Path(folder)
    where = str(folder / gguf_file) if gguf_file else str(folder)
    if gguf_file is None and not any((folder / n).is_file() for n in TOKENIZER_FILES):
        raise FileNotFoundError(
            f"{where}: no tokenizer files (expected one of {list(TOKENIZER_FILES[:3])})"
        )
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    try:
        tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True, **kwargs)
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"{where}: transformers cannot load the tokenizer: {exc}") from exc
    if not tok.chat_template:
        if not chat_template:
            raise ValueError(
                f"{where}: the tokenizer has no chat template (expected `chat_template` in "
                f"tokenizer_config.json, chat_template.jinja, or GGUF "
                f"tokenizer.chat_template); a chat server needs one"
            )
        tok.chat_template = chat_template
    return tok
