"""The cache key: a labelled, length-prefixed digest of everything that changes a compiled kernel.

Each item enters the digest as ``label || len(payload) || payload`` so that no two different inputs can
produce the same byte stream (moving a byte from one field into the next changes the key).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class KeyInputs:
    sources: dict[str, str]  # file name -> rendered source
    headers: dict[str, bytes]  # path relative to the include dir -> contents
    nvcc_version: str  # the full `nvcc --version` banner
    arch: str
    flags: tuple[str, ...]
    flashgen_version: str


def _item(h: "hashlib._Hash", label: str, payload: bytes) -> None:
    label_bytes = label.encode()
    h.update(len(label_bytes).to_bytes(8, "little"))
    h.update(label_bytes)
    h.update(len(payload).to_bytes(8, "little"))
    h.update(payload)


def kernel_key(inputs: KeyInputs) -> str:
    """A hex digest (64 characters); the cache directory uses its first 16."""
    h = hashlib.blake2b(digest_size=32)
    _item(h, "format", b"flashgen-key-1")
    _item(h, "flashgen_version", inputs.flashgen_version.encode())
    _item(h, "nvcc_version", inputs.nvcc_version.encode())
    _item(h, "arch", inputs.arch.encode())
    _item(h, "flags", "\0".join(inputs.flags).encode())
    for name in sorted(inputs.sources):
        _item(h, f"source:{name}", inputs.sources[name].encode())
    for name in sorted(inputs.headers):
        _item(h, f"header:{name}", inputs.headers[name])
    return h.hexdigest()


def read_header_tree(include_dir: Path) -> dict[str, bytes]:
    """Every file under ``include_dir`` (relative posix path -> bytes)."""
    return {
        path.relative_to(include_dir).as_posix(): path.read_bytes()
        for path in sorted(include_dir.rglob("*"))
        if path.is_file()
    }
