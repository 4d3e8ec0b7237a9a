"""Read a runtime package back: check its contract, rebuild its config and plan, and map
its weights. The one way the serving side opens a package (`flare serve`, qualify, tests).

A package folder holds (written by `flare.prepare.package.write_package`):
    model.safetensors   weights, Hugging Face names, serving dtype or the weight
                        format's block parts under suffixed names (`flare.models.quant`)
    tokenizer files     whatever `tokenizer.save_pretrained` writes
    manifest.json       `flare.package.contract.Manifest`
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import PreTrainedTokenizerBase

from flare.loading.tokenizer import load_tokenizer
from flare.models.config import ModelConfig
from flare.models.recipe import recipe_for
from flare.package.contract import Manifest, PackageError, check_package, device_class_of
from flare.package.plan import CapacityPlan, layout_for

WEIGHTS_NAME = "model.safetensors"


@dataclass
class LoadedPackage:
    """A checked package in memory.

    Attributes:
        path: the package folder.
        manifest: its manifest.
        config: model hyper-parameters (from `manifest.config`).
        plan: capacity plan serve allocates from.
        tensors: HF name -> tensor on the requested device, as stored (serving dtype;
            float16 2-D weights for weight format `fp16`). A `PackageTensors` mapping:
            each access reads the tensor from the package file, nothing is held here.
        tokenizer: transformers tokenizer with `chat_template`.
    """

    path: Path
    manifest: Manifest
    config: ModelConfig
    plan: CapacityPlan
    tensors: Mapping[str, torch.Tensor]
    tokenizer: PreTrainedTokenizerBase


class PackageTensors(Mapping[str, torch.Tensor]):
    """Read-only name -> tensor mapping over a safetensors file, reading a tensor (memory
    mapped by safetensors) each time it is asked for, never caching it.

    The model keeps only what it builds from these tensors (fused q/k/v and gate/up,
    weights packed for the kernels), so the weights in memory are the model's alone: a tensor it
    replaced is unmapped when dropped, and the memory report's weight bytes hold.

    Args:
        path: the `model.safetensors` file.
        device: where returned tensors live ("cpu", "cuda:0", ...).
    """

    def __init__(self, path: Path, device: str = "cpu") -> None:
        self.path, self.device = Path(path), device
        with safe_open(str(self.path), framework="pt") as f:
            self._names = list(f.keys())
        self._known = frozenset(self._names)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._known:
            raise KeyError(name)
        with safe_open(str(self.path), framework="pt", device=self.device) as f:
            return f.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def load_package(path: Path, device: str = "cpu") -> LoadedPackage:
    """Check a package (`flare.package.contract.check_package`) and load it.

    Args:
        path: package folder.
        device: where the tensors go ("cpu", "cuda", "cuda:1"); its device class must
            equal the package's.

    Raises:
        PackageError: the package fails a check (message names expected and found),
            including a recipe or state layout that differs from what this build's recipe
            computes for the package's config and plan (`check_state_layout`).
    """
    path = Path(path)
    manifest = check_package(path, device_class=device_class_of(device))
    config, plan = check_state_layout(manifest, where=f"package {str(path)!r}")
    tensors = PackageTensors(path / WEIGHTS_NAME, device=str(torch.device(device)))
    tokenizer = load_tokenizer(path)
    return LoadedPackage(path=path, manifest=manifest, config=config, plan=plan,
                         tensors=tensors, tokenizer=tokenizer)


def check_state_layout(manifest: Manifest, where: str = "package"
                       ) -> tuple[ModelConfig, CapacityPlan]:
    """Rebuild the package's config and plan and check them against this build's recipe:
    the recipe that runs the config must be the manifest's, and the state layout it
    computes at the plan's page size and dtype must equal `manifest.state_layout` (the
    layout is part of the contract: pools are allocated from it, and reused states are
    read through it).

    Returns:
        (config, plan).

    Raises:
        PackageError: an unreadable config or plan, another recipe, or a layout that
            differs (naming the first differing field, with both values).
    """
    try:
        config = ModelConfig.from_hf(manifest.config)
        plan = CapacityPlan.from_dict(manifest.plan)
        recipe = recipe_for(config)
        layout = layout_for(config, plan).describe()
    except (TypeError, ValueError) as exc:
        raise PackageError(f"{where}: config or plan unreadable by this flare: {exc}") from None
    if recipe != manifest.recipe:
        raise PackageError(f"{where}: recipe mismatch: the config runs on {recipe!r}, the "
                           f"package names {manifest.recipe!r}")
    if layout != manifest.state_layout:
        diff = sorted(k for k in set(layout) | set(manifest.state_layout)
                      if layout.get(k) != manifest.state_layout.get(k))
        first = diff[0]
        raise PackageError(
            f"{where}: state layout mismatch in {diff}: recipe {recipe!r} computes "
            f"{first}={layout.get(first)!r}, the package has "
            f"{first}={manifest.state_layout.get(first)!r}; prepare it again")
    if layout["layer_states"] and plan.state_slots < plan.max_num_seqs:
        raise PackageError(f"{where}: plan has {plan.state_slots} state slots for "
                           f"{plan.max_num_seqs} sequences of a hybrid recipe")
    return config, plan
