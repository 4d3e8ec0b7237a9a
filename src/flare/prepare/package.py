"""Write a runtime package (prepare); `flare.package.reader` reads one back (serve).

A package folder holds:
    model.safetensors   weights, Hugging Face names, serving dtype; with weight format
                        `fp16` (manifest tuning "weights") the 2-D weights of a `llama`
                        recipe model are float16; with `q4` (and `q4x8` / `q8x8`, rows
                        interleaved) they are stored as 4-bit / 8-bit block parts under
                        suffixed names (see `flare.models.quant`)
    tokenizer files     whatever `tokenizer.save_pretrained` writes (transformers 5:
                        tokenizer.json, tokenizer_config.json, chat_template.jinja)
    manifest.json       `flare.package.contract.Manifest`
It is written into a temporary sibling folder and renamed into place, so a reader never
sees a half-written package.
"""

from __future__ import annotations

import os
import shutil
import sys
import uuid
from collections.abc import Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tqdm.auto import tqdm

import flare
from flare.package.contract import (
    EXECUTION_ABI,
    MANIFEST_NAME,
    PREPARED_CONTRACT,
    Manifest,
    PackageError,
    check_package,
    device_class_of,
    payload_id,
    read_manifest,
    scan_payload,
)
from flare.loading.checkpoint import load_checkpoint
from flare.loading.source import Checkpoint, checkpoint_format, default_model_name, source_identity
from flare.models.config import ModelConfig
from flare.models.quant.formats import (
    WEIGHT_FORMATS,
    check_weight_format,
    default_kv_dtype,
    default_weight_format,
    fp16_overflow,
)
from flare.models.quant.sizes import serving_weight_bytes
from flare.models.quant.storage import convert_tensors
from flare.models.recipe import RECIPE_VERSIONS, is_hybrid_recipe, recipe_for
from flare.package.plan import (CapacityPlan, check_plan_keywords, dtype_from_name,
                                dtype_name, layout_for, make_plan, memory_report)
from flare.prepare.runtime_base import runtime_base_bytes
from flare.package.reader import WEIGHTS_NAME, check_state_layout
from flare.runtime.boot import usable_cores
from flare.runtime.cuda_graphs import graph_memory_bytes, plan_buckets
from flare.state.layout import StateLayout

def _stage(msg: str, progress: bool) -> None:
    if progress:
        tqdm.write(f"[flare prepare] {msg}", file=sys.stderr)


def device_total_bytes(device: str) -> int:
    """Total memory of `device` in bytes: physical RAM on CPU (sysconf), the GPU's total
    on CUDA (`torch.cuda.mem_get_info`)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return int(torch.cuda.mem_get_info(dev)[1])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def tuning_for(device: str, plan: CapacityPlan) -> dict[str, Any]:
    """Tuning choices recorded in the manifest. Nothing is measured yet: the dict says so."""
    if torch.device(device).type == "cpu":
        threads, how = usable_cores()
        return {"torch_num_threads": threads, "threads_from": how,
                "max_batch_tokens": plan.max_batch_tokens, "measured": False}
    return {"max_batch_tokens": plan.max_batch_tokens, "measured": False}


def _measured_costs(ckpt: Any, tensors: Mapping[str, torch.Tensor], plan: CapacityPlan,
                    folder: Path, device: str, progress: bool) -> dict[str, Any]:
    """Prefill and transfer speeds for the restore cost policy (`flare.prepare.tune`),
    with `tensors` as the package stores them (so prefill runs the served kernels)."""
    from flare.prepare.tune import restore_cost_inputs

    _stage("measuring prefill and transfer speeds (restore cost policy)", progress)
    return restore_cost_inputs(ckpt.config, plan, tensors, ckpt.tokenizer, folder, device)


def graph_capture_for(device: str, plan: CapacityPlan | None = None, recipe: str = "llama",
                      attention: str = "sdpa") -> dict[str, Any]:
    """The graph capture plan of the manifest.

    On CPU nothing is captured; hybrid recipes decode eagerly (no static decode step);
    on CUDA for recipe `llama`: {"enabled": True, "batch_sizes": [...], "context_pages":
    [...], "attention": `attention`} from `flare.runtime.cuda_graphs.plan_buckets`.

    Raises:
        ValueError: CUDA and `llama` without a plan.
    """
    if torch.device(device).type == "cpu":
        return {"enabled": False, "reason": "CPU: CUDA graphs do not apply"}
    if is_hybrid_recipe(recipe):
        return {"enabled": False, "reason": f"recipe {recipe!r} keeps layer states: hybrid "
                                            f"recipes decode eagerly"}
    if plan is None:
        raise ValueError("graph_capture_for: a CUDA package needs its capacity plan")
    return plan_buckets(plan.max_num_seqs, plan.pages_per_seq, plan.page_size,
                        attention).to_manifest()


def _graph_bytes(capture: dict[str, Any], layout: StateLayout, vocab_size: int) -> int:
    """Device bytes the capture plan adds (0 when disabled)."""
    from flare.runtime.cuda_graphs import GraphPlan

    graphs = GraphPlan.from_manifest(capture)
    if graphs is None:
        return 0
    per_token_layer = layout.kv_bytes_per_token // max(layout.num_kv_layers, 1)
    return graph_memory_bytes(graphs, page_bytes=layout.bytes_per_page,
                              kv_bytes_per_token_layer=per_token_layer,
                              page_size=layout.page_size, vocab_size=vocab_size)


def _decode_attention_tuning(ckpt: Checkpoint, plan: CapacityPlan, device: str,
                             recipe: str, progress: bool) -> dict[str, Any]:
    """tuning["decode_attention"] of a CUDA `llama` package (`flare.prepare.attention_tune`);
    {} elsewhere."""
    if torch.device(device).type != "cuda" or is_hybrid_recipe(recipe):
        return {}
    from flare.prepare.attention_tune import measure_decode_attention

    _stage("timing decode attention kernels", progress)
    c = ckpt.config
    return {"decode_attention": measure_decode_attention(
        num_seqs=plan.max_num_seqs, tokens=plan.max_seq_len, num_heads=c.num_attention_heads,
        num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim, page_size=plan.page_size,
        dtype=dtype_from_name(plan.dtype), device=device)}


def write_package(
    ckpt: Checkpoint,
    out_dir: Path,
    *,
    model_name: str | None = None,
    device: str = "cpu",
    progress: bool = True,
    weights: str | None = None,
    **plan_kwargs: Any,
) -> Manifest:
    """Plan, tune and write a package from a loaded checkpoint (its tensors' dtype is the
    serving dtype). See `prepare_package` for arguments and errors."""
    check_plan_keywords(plan_kwargs)
    out_dir = Path(out_dir)
    _refuse_foreign_folder(out_dir)
    serving_dtype = dtype_name(next(iter(ckpt.tensors.values())).dtype)
    dtype_from_name(serving_dtype)  # refuse a dtype the plan does not know
    device_class = device_class_of(device)
    recipe = recipe_for(ckpt.config)
    fmt = weights or default_weight_format(dtype=serving_dtype, device=device, recipe=recipe,
                                           source=ckpt.source)
    check_weight_format(fmt, dtype=serving_dtype, device=device, recipe=recipe)
    if weights is None and fmt == "fp16" and fp16_overflow(ckpt.tensors) is not None:
        fmt = "full"  # the default never turns a weight infinite; asked for, it raises
    if plan_kwargs.get("kv_dtype") is None:  # the format's default pool (float16 for int8)
        plan_kwargs["kv_dtype"] = default_kv_dtype(fmt, dtype=serving_dtype, device=device)
    stored = convert_tensors(ckpt.tensors, fmt, ckpt.blocks)  # a GGUF's own blocks
    weights_bytes = ckpt.weights_bytes
    if recipe == "llama":  # what the model holds: fused parts, the kernels' packed layout
        weights_bytes = serving_weight_bytes(stored, fmt, ckpt.config.tie_word_embeddings,
                                             device=device)

    _stage("planning", progress)
    plan = make_plan(ckpt.config, dtype=serving_dtype, **plan_kwargs)
    layout = layout_for(ckpt.config, plan)
    attention = _decode_attention_tuning(ckpt, plan, device, recipe, progress)
    capture = graph_capture_for(device, plan, recipe,
                                attention.get("decode_attention", {}).get("choice", "sdpa"))
    report = memory_report(ckpt.config, plan, weights_bytes, device_total_bytes(device),
                           host_is_device=device_class == "cpu",
                           graph_bytes=_graph_bytes(capture, layout, ckpt.config.vocab_size),
                           runtime_bytes=runtime_base_bytes())

    stored_bytes = sum(t.numel() * t.element_size() for t in stored.values())
    _stage(f"writing {stored_bytes / 2**20:,.0f} MiB of weights (format {fmt}) to {out_dir}",
           progress)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        save_file(stored, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        os.chmod(tmp / WEIGHTS_NAME, 0o644)  # safetensors writes 0600; the rest is 0644
        ckpt.tokenizer.save_pretrained(str(tmp))
        payload = scan_payload(tmp)
        manifest = Manifest(
            execution_abi=EXECUTION_ABI,
            prepared_contract=PREPARED_CONTRACT,
            package_id=payload_id(payload),
            model_name=model_name or ckpt.name,
            recipe=recipe,
            recipe_version=RECIPE_VERSIONS[recipe],
            source=ckpt.source,
            config=ckpt.config.to_hf(),
            state_layout=layout.describe(),
            dtype=serving_dtype,
            device_class=device_class,
            plan=plan.to_dict(),
            memory=report.to_dict(),
            tuning=tuning_for(device, plan) | {"weights": fmt} | attention | _measured_costs(
                ckpt, stored, plan, out_dir.parent, device, progress),
            graph_capture=capture,
            flare_version=flare.__version__,
            torch_version=torch.__version__,
            created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            payload=payload,
        )
        manifest.write(tmp)
        _swap_into_place(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _stage(f"done: package {manifest.package_id[:12]} at {out_dir}", progress)
    return manifest


def prepare_package(
    model_path: Path,
    out_dir: Path,
    *,
    dtype: str = "float32",
    model_name: str | None = None,
    device: str = "cpu",
    progress: bool = True,
    weights: str | None = None,
    **plan_kwargs: Any,
) -> Manifest:
    """Build a runtime package from a GGUF file or a Hugging Face folder.

    Stages (shown on stderr when `progress`): loading, dequantizing, planning, writing.
    The embedded model (135M, fp32 serving dtype) takes about 15 s on 2 cores, writing
    269 MB of float16 weights (weight format `fp16`; 538 MB with `full`).

    Args:
        model_path: `.gguf` file or Hugging Face folder.
        out_dir: package folder to create; an existing package there is replaced
            atomically (a temporary sibling folder is renamed into place).
        dtype: serving dtype name: "float32", "bfloat16" or "float16".
        model_name: overrides the name taken from the file or folder.
        device: "cpu" or "cuda[:N]": the device class the package is prepared for; its
            total memory bounds the plan.
        weights: weight format of the linear layers, "full", "fp16", "q4", "q4x8" or
            "q8x8" (`flare.models.quant`); None = `default_weight_format`: on CPU with
            float32 for recipe `llama` "q4x8" for a GGUF of Q4_1 / Q4_0 layers, "q8x8"
            for one of Q8_0 layers, else "fp16"; "full" elsewhere. Recorded as
            tuning["weights"].
        plan_kwargs: the capacity plan, as `flare.package.plan.make_plan`'s keywords and
            defaults (max_seq_len, max_num_seqs, page_size, num_pages, max_batch_tokens;
            hybrid recipes' checkpoint_slots and checkpoint_interval, where a non-zero
            value for a KV-only recipe raises ValueError; host_tier_bytes and
            disk_tier_bytes, 0 = no such tier; kv_dtype, None = `default_kv_dtype` for
            the format: float16 for q4x8 / q8x8 / kx8, else the serving dtype).

    Returns:
        The written manifest.

    Raises:
        TypeError: a keyword `make_plan` does not take (before anything is loaded).
        FileNotFoundError: model path or a file it needs is missing.
        ValueError: bad dtype or plan value, a plan that does not fit the device,
            unsupported model, a weight format that does not apply (named), or `out_dir`
            an existing non-package folder.
        PackageError: `device` is CUDA on a machine without CUDA.
    """
    torch_dtype = dtype_from_name(dtype)
    check_plan_keywords(plan_kwargs)  # fail before the slow load
    checkpoint_format(Path(model_path))
    device_class_of(device)
    if weights is not None and weights not in WEIGHT_FORMATS:  # fail before the slow load
        check_weight_format(weights, dtype=dtype, device=device, recipe="llama")
    _refuse_foreign_folder(Path(out_dir))
    _stage(f"loading {model_path}", progress)
    ckpt = load_checkpoint(Path(model_path), dtype=torch_dtype, progress=progress)
    return write_package(ckpt, out_dir, model_name=model_name, device=device,
                         progress=progress, weights=weights, **plan_kwargs)


def _refuse_foreign_folder(out_dir: Path) -> None:
    # Replacing a package is fine; replacing someone's unrelated folder is not.
    if out_dir.exists() and (not out_dir.is_dir() or (
            any(out_dir.iterdir()) and not (out_dir / MANIFEST_NAME).is_file())):
        raise ValueError(f"output {str(out_dir)!r} exists and is not a flare package; "
                         f"refusing to replace it (choose another --out or remove it)")


def _swap_into_place(tmp: Path, out_dir: Path) -> None:
    # rename() cannot replace a non-empty folder: move the old package aside first, so
    # out_dir always names either the old or the new complete package.
    old = None
    if out_dir.exists():
        old = out_dir.parent / f".{out_dir.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(out_dir, old)
    os.replace(tmp, out_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def reuse_problem(package: Path, model_path: Path, *, dtype: str = "float32",
                  device: str = "cpu", weights: str | None = None,
                  **plan_kwargs: Any) -> str | None:
    """Why the package at `package` cannot stand for preparing `model_path` with these
    settings, or None when it can: it must pass `check_package`, come from the same source
    files (format and per-file sha256), and have the same dtype, weight format (None:
    the default for its recipe) and the plan these settings would make."""
    try:
        manifest = check_package(package, device_class=device_class_of(device))
    except PackageError as exc:
        return str(exc)
    want = source_identity(Path(model_path))
    have = manifest.source
    if (have.get("format"), have.get("files")) != (want["format"], want["files"]):
        return f"source changed: package built from {have.get('files')}, model is {want['files']}"
    if manifest.dtype != dtype:
        return f"dtype differs: package {manifest.dtype}, wanted {dtype}"
    want_fmt = weights or default_weight_format(dtype=dtype, device=device,
                                                recipe=manifest.recipe, source=have)
    have_fmt = manifest.tuning.get("weights", "full")
    if have_fmt != want_fmt:
        return f"weight format differs: package {have_fmt}, wanted {want_fmt}"
    try:
        check_state_layout(manifest)
    except PackageError as exc:
        return str(exc)
    if plan_kwargs.get("kv_dtype") is None:
        plan_kwargs = plan_kwargs | {"kv_dtype": default_kv_dtype(want_fmt, dtype=dtype,
                                                                  device=device)}
    plan = make_plan(ModelConfig.from_hf(manifest.config), dtype=dtype, **plan_kwargs)
    if plan.to_dict() != manifest.plan:
        return f"plan differs: package {manifest.plan}, wanted {plan.to_dict()}"
    return None


def ensure_package(model_path: Path, cache_dir: Path, *, dtype: str = "float32",
                   model_name: str | None = None, device: str = "cpu", progress: bool = True,
                   weights: str | None = None, **plan_kwargs: Any) -> Path:
    """A checked package for `model_path` under `cache_dir`, reused when valid.

    The package lives at `cache_dir/<model name>-<dtype>`, with `-<weights>` appended
    when a weight format is asked for and `-kv-<kv_dtype>` when a KV pool dtype is (so
    packages of two formats, or two pools, do not replace each other). It is
    reused when
    `reuse_problem` finds nothing wrong (contract, payload hashes, same source files,
    dtype, plan); otherwise it is rebuilt with `prepare_package` (the reason is shown
    when `progress`).

    Args:
        weights: weight format (None: the recipe's default, see `prepare_package`).
        plan_kwargs: `make_plan`'s keywords, as `prepare_package`.

    Returns:
        The package folder.

    Raises:
        As `prepare_package`.
    """
    model_path = Path(model_path)
    checkpoint_format(model_path)
    name = model_name or default_model_name(model_path)
    kv = plan_kwargs.get("kv_dtype")
    out = Path(cache_dir) / (f"{name}-{dtype}" + (f"-{weights}" if weights else "")
                             + (f"-kv-{kv}" if kv else ""))
    if (out / MANIFEST_NAME).is_file():
        problem = reuse_problem(out, model_path, dtype=dtype, device=device, weights=weights,
                                **plan_kwargs)
        if problem is None:
            _stage(f"reusing package {read_manifest(out).package_id[:12]} at {out}", progress)
            return out
        _stage(f"rebuilding {out}: {problem}", progress)
    prepare_package(model_path, out, dtype=dtype, model_name=model_name, device=device,
                    progress=progress, weights=weights, **plan_kwargs)
    return out

