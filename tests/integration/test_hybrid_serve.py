"""Hybrid recipes end to end: `flare prepare` a saved tiny checkpoint, `flare serve` it,
chat over HTTP with the official client, and reuse the conversation state on turn 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import openai
import pytest

from flare.qualify.server import ManagedServer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "unit"))
from hybrid_models import save_tiny_lfm2, save_tiny_qwen3_5  # noqa: E402

pytestmark = pytest.mark.slow
SAVERS = {"qwen3_5": save_tiny_qwen3_5, "lfm2": save_tiny_lfm2}


@pytest.mark.parametrize("recipe", sorted(SAVERS))
def test_prepare_serve_chat_and_reuse_over_http(recipe, tmp_path, embedded_checkpoint):
    folder = tmp_path / recipe
    SAVERS[recipe](folder, embedded_checkpoint.tokenizer)
    pkg = tmp_path / "pkg"
    done = subprocess.run([sys.executable, "-m", "flare.cli", "prepare", str(folder),
                           "--out", str(pkg), "--max-seq-len", "1024", "--max-num-seqs", "2"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    with ManagedServer(pkg, tmp_path / "server.log") as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
        model = client.models.list().data[0].id
        history = [{"role": "user", "content": "Summarize what a recurrent state is. " * 8}]
        first = client.chat.completions.create(model=model, messages=history, max_tokens=12,
                                               temperature=0)
        assert first.choices[0].finish_reason in ("length", "stop")
        history += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "And a convolution state?"}]
        second = client.chat.completions.create(model=model, messages=history, max_tokens=12,
                                                temperature=0)
        # turn 1's prompt ended in a checkpoint, so at least that much is reused
        assert second.usage.prompt_tokens_details.cached_tokens >= 16
        assert second.usage.prompt_tokens > first.usage.prompt_tokens
