"""The lookup index: a warm hit without rendering the source or probing the compiler.

The content key of a kernel needs its rendered source and the header tree; computing it costs a Jinja render
and a read of every header (tens of ms in a fresh process). The index maps what determines the render to the
entry instead: ``<root>/<arch>/.index/<lookup key[:32]>.json`` holds ``{"entry": <folder name>, "content_key":
..., "toolchain": ...}``. The lookup key (``lookup_key``) is a labelled digest of the op, the projected spec,
the family's options, the arch, flashgen's version and the digest of the sources that render the kernel
(templates, headers and the code generator's Python files: in a development checkout they change without a
new version). An index file names the entry by its folder name, never by an absolute path, so a cache
stays relocatable.

A hit reads one index file and one manifest, and loads the cubin only if the manifest's ``content_key`` is
the one the index recorded (an entry replaced or rebuilt from other sources is a miss). Anything wrong (no
index file, unreadable, another format, a missing or corrupt entry) is a miss: the caller renders and keys as
before, and records the index file again.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from pathlib import Path

from .store import Entry, read_entry

INDEX_DIR = ".index"
INDEX_FORMAT = "flashgen-index-1"


def _item(h: "hashlib._Hash", label: str, payload: bytes) -> None:
    h.update(len(label).to_bytes(8, "little") + label.encode() + len(payload).to_bytes(8, "little") + payload)


def lookup_key(op: str, spec: dict, options: tuple, arch: str, flashgen_version: str, sources_digest: str) -> str:
    """A hex digest of what decides a kernel's rendered source (``spec``: the projected spec as a dict)."""
    h = hashlib.blake2b(digest_size=32)
    for label, value in (("format", INDEX_FORMAT), ("op", op), ("spec", json.dumps(spec, sort_keys=True)),
                         ("options", json.dumps(sorted(options))), ("arch", arch),
                         ("flashgen_version", flashgen_version), ("sources", sources_digest)):
        _item(h, label, value.encode())
    return h.hexdigest()


def index_path(root: Path, arch: str, key: str) -> Path:
    return Path(root) / arch / INDEX_DIR / f"{key[:32]}.json"


def lookup(root: Path, arch: str, key: str, toolchain: str) -> Entry | None:
    """The sound entry the index of ``root`` records for ``key``, or None. ``toolchain``: the local compiler's
    identity ("" when there is none); an entry recorded with another compiler is a miss where one is
    present (the caller then keys with the compiler's version, as without the index)."""
    try:
        record = json.loads(index_path(root, arch, key).read_bytes())
        name, content_key, built_with = record["entry"], record["content_key"], record["toolchain"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(name, str) or "/" in name or name.startswith(".") or (toolchain and built_with != toolchain):
        return None
    entry, _ = read_entry(Path(root) / arch / name)
    if entry is None or entry.manifest.get("content_key") != content_key:
        return None
    return entry


def record(root: Path, arch: str, key: str, entry: Entry, toolchain: str) -> bool:
    """Write the index file of ``key`` -> ``entry`` (an entry folder of ``root``) atomically; False where the
    root cannot be written (the index is an optimisation: a lookup still works without it)."""
    data = json.dumps({"entry": entry.path.name, "content_key": entry.manifest.get("content_key"),
                       "toolchain": toolchain}, sort_keys=True)
    return write_atomic(index_path(root, arch, key), data)


def write_atomic(path: Path, data: str) -> bool:
    """Write ``data`` to ``path`` through a temporary file and one rename; False where it cannot be written."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(data)
        os.replace(tmp, path)
    except OSError:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        return False
    return True
