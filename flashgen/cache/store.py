"""The on-disk kernel cache: ``<root>/<arch>/<uri>-<hash16>/`` holding the source, build.ninja, the cubin,
the ptxas resource report and ``manifest.json``.

Writers build in a temporary folder beside the entries and publish it with one ``os.rename`` while holding
the entry's file lock, so readers never see a half-written entry and need no lock. Every read checks the
cubin against the digest in the manifest; a truncated or corrupt entry counts as a miss and is rebuilt.
Read-only extra roots (AOT caches shipped with a deployment) are searched before the writable root.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

import filelock

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1


@dataclass(frozen=True)
class Entry:
    path: Path
    manifest: dict
    cubin: bytes

    @property
    def uri(self) -> str:
        return self.manifest["uri"]


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_entry(path: Path, key: str | None = None) -> tuple[Entry | None, str]:
    """Load and verify one entry folder: (entry, "") if sound, else (None, what is wrong)."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        return None, "no manifest"
    except (OSError, ValueError) as exc:
        return None, f"unreadable manifest: {exc}"
    if manifest.get("format") != MANIFEST_FORMAT:
        return None, f"manifest format {manifest.get('format')!r}, expected {MANIFEST_FORMAT}"
    if key is not None and manifest.get("key") != key:
        return None, "manifest key does not match the folder"
    try:
        cubin = (path / manifest["cubin"]).read_bytes()
    except (OSError, KeyError) as exc:
        return None, f"cubin unreadable: {exc}"
    if len(cubin) != manifest.get("cubin_size") or _sha256(cubin) != manifest.get("cubin_sha256"):
        return None, "cubin does not match its digest (truncated or corrupt)"
    return Entry(path, manifest, cubin), ""


class CacheStore:
    def __init__(self, root: Path, extra_roots: list[Path] | tuple[Path, ...] = ()):
        self.root = Path(root)
        self.extra_roots = tuple(Path(r) for r in extra_roots)

    @staticmethod
    def entry_name(uri: str, key: str) -> str:
        return f"{uri}-{key[:16]}"

    def entry_dir(self, arch: str, uri: str, key: str, root: Path | None = None) -> Path:
        return (root or self.root) / arch / self.entry_name(uri, key)

    def lookup(self, arch: str, uri: str, key: str) -> Entry | None:
        """The sound entry for this key, read-only roots first; None on a miss or a corrupt entry."""
        for root in (*self.extra_roots, self.root):
            entry, _ = read_entry(self.entry_dir(arch, uri, key, root), key)
            if entry is not None:
                return entry
        return None

    def lock(self, arch: str, uri: str, key: str) -> filelock.FileLock:
        folder = self.root / arch
        folder.mkdir(parents=True, exist_ok=True)
        return filelock.FileLock(str(folder / f".{self.entry_name(uri, key)}.lock"))

    def new_build_dir(self, arch: str, uri: str, key: str) -> Path:
        """A fresh folder on the cache's filesystem to build in (so publishing is one rename)."""
        path = self.root / arch / ".tmp" / f"{self.entry_name(uri, key)}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        path.mkdir(parents=True)
        return path

    def publish(self, build_dir: Path, arch: str, uri: str, key: str, manifest: dict, cubin_name: str) -> Entry:
        """Write the manifest into ``build_dir`` and move it into place. Call with the entry's lock held."""
        cubin = (build_dir / cubin_name).read_bytes()
        manifest = {
            **manifest,
            "format": MANIFEST_FORMAT,
            "uri": uri,
            "key": key,
            "arch": arch,
            "cubin": cubin_name,
            "cubin_size": len(cubin),
            "cubin_sha256": _sha256(cubin),
        }
        tmp = build_dir / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True))
        os.replace(tmp, build_dir / MANIFEST)
        final = self.entry_dir(arch, uri, key)
        if final.exists():  # a corrupt entry (a sound one would have been found before building)
            trash = final.with_name(f".trash-{final.name}-{uuid.uuid4().hex[:8]}")
            os.rename(final, trash)
            shutil.rmtree(trash, ignore_errors=True)
        os.rename(build_dir, final)
        return Entry(final, manifest, cubin)

    # ------------------------------------------------------------------------------------------ maintenance

    def entry_dirs(self, root: Path | None = None) -> list[Path]:
        base = root or self.root
        if not base.is_dir():
            return []
        return sorted(p for arch in base.iterdir() if arch.is_dir() for p in arch.iterdir()
                      if p.is_dir() and not p.name.startswith("."))

    def verify(self) -> list[tuple[Path, str]]:
        """(folder, problem) for every unsound entry of the writable root."""
        return [(p, problem) for p in self.entry_dirs() for _, problem in [read_entry(p)] if problem]

    def size_bytes(self) -> int:
        if not self.root.is_dir():
            return 0
        return sum(f.stat().st_size for f in self.root.rglob("*") if f.is_file())

    def clean(self, only_corrupt: bool = False) -> list[Path]:
        """Remove entries (all, or only unsound ones) and leftover build folders; return what went."""
        doomed = [p for p, _ in self.verify()] if only_corrupt else self.entry_dirs()
        if self.root.is_dir():
            for arch in self.root.iterdir():
                if (arch / ".tmp").is_dir():
                    doomed.append(arch / ".tmp")
        for path in doomed:
            shutil.rmtree(path, ignore_errors=True)
        return doomed
