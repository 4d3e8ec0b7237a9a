"""Record codec of the disk tier: one self-describing, checksummed file per state part.

A record holds one part of a conversation's state (a full KV page, a partly filled tail
page, or a checkpoint of the hybrid layers' states) with everything needed to check, on
read, that it is whole and that it belongs to the reader: namespace (the package id),
layout, format version, its keys and the tokens it covers.

Byte format (format version 1; integers little-endian):

    offset   size  field
    0        8     magic b"FLRSTATE"
    8        4     format version, uint32 (FORMAT_VERSION)
    12       4     H: header length in bytes, uint32
    16       H     header: UTF-8 JSON object, keys sorted, no whitespace:
                     "namespace": str, "layout": str, "kind": "page" | "tail" | "checkpoint",
                     "key": 32 hex chars, "parent": 32 hex chars, "tokens": [int, ...],
                     "position": int,
                     "tensors": [{"name": str, "dtype": str (e.g. "bfloat16"),
                                  "shape": [int, ...], "nbytes": int,
                                  "blake2b": 64 hex chars}, ...]
    16+H     32    BLAKE2b-256 digest of bytes [0, 16+H) (magic, version, length, header)
    48+H     ...   each tensor's raw bytes in header order: C-contiguous, the host's
                   little-endian element encoding, exactly `nbytes` bytes, no padding

The file is exactly 48 + H + sum(nbytes) bytes long. Each tensor's `blake2b` is the
BLAKE2b-256 digest of its bytes; since the header digest covers the header, every byte of
the file is covered by some digest. A reader checks, in this order: magic, version, header
digest, header fields (namespace, layout, key), file length, then each tensor digest; the
first failure rejects the record whole (`RecordError` with a reason), so no caller ever
sees part of one.
"""

from __future__ import annotations

import hashlib
import json
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import BinaryIO

import torch

FORMAT_VERSION = 1
MAGIC = b"FLRSTATE"
KINDS = ("page", "tail", "checkpoint")
KEY_BYTES = 16
DIGEST_BYTES = 32
_PREFIX = struct.Struct("<8sII")  # magic, format version, header length
PREFIX_BYTES = _PREFIX.size  # 16
_MAX_HEADER = 64 << 20  # a header longer than this is corruption, not a record

# Why a fixed table: a header names dtypes as text, and only these map back to a torch
# dtype with a known element size (never `getattr(torch, name)` on file contents).
DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.uint8,
              torch.int8, torch.int16, torch.int32, torch.int64, torch.bool,
              getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None))
    if d is not None
}

# Reasons a record is rejected, one counter each in the tier's stats.
REASONS = ("checksum", "truncated", "namespace", "version", "layout", "missing",
           "malformed", "io")


class RecordError(Exception):
    """A record file that must not be used; `reason` is one of `REASONS`."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(frozen=True, eq=False)  # tensors make == ambiguous: compare fields
class StateRecord:
    """One part of a conversation state, as the disk tier stores it.

    Attributes:
        kind: "page" (a full KV page), "tail" (a partly filled KV page) or "checkpoint"
            (hybrid layer states at one position).
        key: 16-byte lookup key; for a page the chained key of `prefix_index.page_key`.
        parent: 16-byte chained key of the full pages before this part (the namespace's
            `root_key` when there are none).
        tokens: token ids this part covers (a page's tokens; a checkpoint's tail tokens).
        position: token position at the end of this part (a checkpoint's P).
        tensors: CPU tensors by name, any shape, a dtype of `DTYPES`.

    Raises:
        ValueError: a kind not in `KINDS`, a key or parent that is not 16 bytes, a
            negative position, a tensor name that is not a string.
    """

    kind: str
    key: bytes
    parent: bytes
    tokens: tuple[int, ...]
    position: int
    tensors: dict[str, torch.Tensor]

    @property
    def nbytes(self) -> int:
        """Bytes of the record's tensors."""
        return sum(t.nbytes for t in self.tensors.values())

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"record kind {self.kind!r} is not one of {KINDS}")
        for name in ("key", "parent"):
            value = getattr(self, name)
            if not isinstance(value, bytes) or len(value) != KEY_BYTES:
                raise ValueError(f"record {name} must be {KEY_BYTES} bytes, got {value!r}")
        if self.position < 0:
            raise ValueError(f"record position must be >= 0, got {self.position}")
        if not all(isinstance(n, str) for n in self.tensors):
            raise ValueError("record tensor names must be strings")


@dataclass(frozen=True)
class EncodedRecord:
    """A record ready to write: `head` (prefix, header, header digest) then `payloads`.

    Attributes:
        head: bytes [0, 48 + H) of the file.
        payloads: each tensor's bytes (views of the tensors, no copy when contiguous).
        nbytes: the file's exact length in bytes.
    """

    head: bytes
    payloads: tuple[memoryview, ...]
    nbytes: int


def encode(record: StateRecord, namespace: str, layout: str,
           version: int = FORMAT_VERSION) -> EncodedRecord:
    """Serialize a record's header and hash its tensors (the tensors are not copied).

    Raises:
        ValueError: a tensor's dtype is not in `DTYPES`, or the host is big-endian.
    """
    if sys.byteorder != "little":
        raise ValueError("the disk tier format stores little-endian elements only")
    table, payloads = [], []
    for name, tensor in record.tensors.items():
        data = _tensor_bytes(name, tensor)
        table.append({"name": name, "dtype": str(tensor.dtype).removeprefix("torch."),
                      "shape": list(tensor.shape), "nbytes": data.nbytes,
                      "blake2b": _digest(data).hex()})
        payloads.append(data)
    header = json.dumps({
        "namespace": namespace, "layout": layout, "kind": record.kind,
        "key": record.key.hex(), "parent": record.parent.hex(),
        "tokens": [int(t) for t in record.tokens], "position": int(record.position),
        "tensors": table,
    }, sort_keys=True, separators=(",", ":")).encode()
    prefix = _PREFIX.pack(MAGIC, version, len(header)) + header
    head = prefix + _digest(prefix)
    return EncodedRecord(head, tuple(payloads), len(head) + sum(p.nbytes for p in payloads))


def write(f: BinaryIO, encoded: EncodedRecord) -> None:
    """Write an encoded record to an open binary file (the caller flushes and syncs)."""
    f.write(encoded.head)
    for data in encoded.payloads:
        f.write(data)


def read(f: BinaryIO, size: int, namespace: str, layout: str, key: bytes,
         version: int = FORMAT_VERSION) -> StateRecord:
    """Read and verify a whole record from an open binary file of `size` bytes.

    Args:
        f: the file, positioned at 0.
        size: its length in bytes (from fstat).
        namespace, layout, version: what the reader accepts.
        key: the key the record must carry (the index's row for it).

    Returns:
        The record, with fresh CPU tensors that share nothing with the file.

    Raises:
        RecordError: the first check that failed; nothing of the record is returned.
        OSError: the file could not be read.
    """
    if size < PREFIX_BYTES:
        raise RecordError("truncated", f"{size} bytes, shorter than the fixed prefix")
    prefix = _read_exact(f, PREFIX_BYTES)
    magic, file_version, header_len = _PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise RecordError("checksum", f"bad magic {magic!r}")
    if file_version != version:
        raise RecordError("version", f"format version {file_version}, expected {version}")
    if header_len > _MAX_HEADER:
        raise RecordError("malformed", f"header length {header_len}")
    if size < PREFIX_BYTES + header_len + DIGEST_BYTES:
        raise RecordError("truncated", f"{size} bytes, header needs more")
    header = _read_exact(f, header_len)
    if _digest(prefix + header) != _read_exact(f, DIGEST_BYTES):
        raise RecordError("checksum", "header digest differs")
    meta = _parse_header(header)
    if meta["namespace"] != namespace:
        raise RecordError("namespace", f"namespace {meta['namespace']!r}, "
                                       f"expected {namespace!r}")
    if meta["layout"] != layout:
        raise RecordError("layout", f"layout {meta['layout']!r}, expected {layout!r}")
    if meta["key"] != key.hex():
        raise RecordError("malformed", f"key {meta['key']}, expected {key.hex()}")
    expected = PREFIX_BYTES + header_len + DIGEST_BYTES + sum(t["nbytes"] for t in
                                                              meta["tensors"])
    if size != expected:
        reason = "truncated" if size < expected else "malformed"
        raise RecordError(reason, f"{size} bytes, expected {expected}")
    tensors = {t["name"]: _read_tensor(f, t) for t in meta["tensors"]}
    return StateRecord(meta["kind"], key, bytes.fromhex(meta["parent"]),
                       tuple(meta["tokens"]), meta["position"], tensors)


# ---- helpers ------------------------------------------------------------------------------

def _digest(data: bytes | memoryview) -> bytes:
    return hashlib.blake2b(data, digest_size=DIGEST_BYTES).digest()


def _tensor_bytes(name: str, tensor: torch.Tensor) -> memoryview:
    """A byte view of a tensor's elements (C order); copies only a non-contiguous one."""
    if tensor.dtype not in DTYPES.values():
        raise ValueError(f"tensor {name!r}: dtype {tensor.dtype} cannot be stored")
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    # Why uint8 first: numpy has no bfloat16, but every dtype views as bytes.
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def _read_exact(f: BinaryIO, n: int) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise RecordError("truncated", f"read {len(data)} of {n} bytes")
    return data


def _parse_header(header: bytes) -> dict:
    """The header's fields, type-checked (a header that passed its digest but is not one
    this version writes is `malformed`, e.g. written by a buggy or foreign tool)."""
    try:
        meta = json.loads(header)
        ok = (meta["kind"] in KINDS and isinstance(meta["namespace"], str)
              and isinstance(meta["layout"], str) and _is_key_hex(meta["key"])
              and _is_key_hex(meta["parent"]) and _ints(meta["tokens"])
              and _ints([meta["position"]]) and meta["position"] >= 0
              and all(_tensor_entry_ok(t) for t in meta["tensors"]))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise RecordError("malformed", f"header: {e}") from None
    if not ok:
        raise RecordError("malformed", "header fields of the wrong type")
    return meta


def _tensor_entry_ok(t: dict) -> bool:
    if not (isinstance(t["name"], str) and t["dtype"] in DTYPES and _ints(t["shape"])
            and _ints([t["nbytes"]]) and isinstance(t["blake2b"], str)):
        return False
    numel = 1
    for d in t["shape"]:
        if d < 0:
            return False
        numel *= d
    return numel * _element_size(DTYPES[t["dtype"]]) == t["nbytes"]


def _read_tensor(f: BinaryIO, entry: dict) -> torch.Tensor:
    """Read one tensor straight into fresh memory and check its digest."""
    tensor = torch.empty(entry["shape"], dtype=DTYPES[entry["dtype"]])
    buf = memoryview(tensor.reshape(-1).view(torch.uint8).numpy()).cast("B")
    done = 0
    while done < len(buf):
        n = f.readinto(buf[done:])
        if not n:
            raise RecordError("truncated", f"tensor {entry['name']!r} ends early")
        done += n
    if _digest(buf).hex() != entry["blake2b"]:
        raise RecordError("checksum", f"tensor {entry['name']!r} digest differs")
    return tensor


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _is_key_hex(value: object) -> bool:
    return isinstance(value, str) and len(value) == 2 * KEY_BYTES and all(
        c in "0123456789abcdef" for c in value)


def _ints(values: Sequence[object]) -> bool:
    return isinstance(values, list) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in values)
