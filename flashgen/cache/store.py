"""The on-disk kernel cache: ``<root>/<arch>/<uri>-<hash16>/`` holding the source, build.ninja, the cubin,
the ptxas resource report and ``manifest.json``.

Writers build in a temporary folder beside the entries and publish it with one ``os.rename`` while holding
the entry's file lock, so readers never see a half-written entry and need no lock. Every read checks the
cubin against the digest in the manifest; a truncated or corrupt entry counts as a miss and is rebuilt. The
manifest also holds the size and digest of every other file of the entry, which ``verify`` checks.
Read-only extra roots (AOT caches shipped with a deployment) are searched before the writable root.

Build folders live in ``<root>/<arch>/.tmp/<uri>-<hash16>.<pid>.<random>``, made and used only while the
builder holds the entry's lock. A folder whose entry lock is free has no builder: the build crashed, was
killed, or failed (its source is kept for the error message). ``clean`` removes such folders and no
others, so a build running in another process is never disturbed; a new build sweeps those whose builder
process has exited (or that are over an hour old), taking the entry's lock for each removal.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import filelock

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
BUILD_DIRS = ".tmp"  # per arch: the folders builds run in
STALE_BUILD_SECONDS = 3600  # a lock-free build folder this old is swept even if its process still runs


class CacheError(RuntimeError):
    """The writable cache cannot be used (read-only, not a folder, ...): the message names the path and the fix."""


def _unwritable(root: Path, path: Path, exc: OSError) -> CacheError:
    """A one-line CacheError for an OSError met while writing under ``root``."""
    if exc.errno in (errno.ENOTDIR, errno.EEXIST):
        blocker = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), path)
        problem = f"{blocker} is not a folder"
    elif exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        problem = f"it is read-only ({exc.strerror}: {exc.filename or path})"
    else:
        problem = f"{exc.strerror or exc} ({exc.filename or path})"
    return CacheError(
        f"kernel cache {root} cannot be written: {problem}; set FLASHGEN_CACHE_DIR to a writable folder "
        "(a read-only cache of prebuilt kernels goes in FLASHGEN_EXTRA_CACHE_DIRS)"
    )


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


def read_entry(path: Path, key: str | None = None, deep: bool = False) -> tuple[Entry | None, str]:
    """Load and verify one entry folder: (entry, "") if sound, else (None, what is wrong). The cubin is checked
    against its digest always; ``deep`` checks every other file the manifest lists too (source, PTX, logs:
    nothing loads them, so a lookup does not read them)."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        return None, "no manifest"
    except (OSError, ValueError) as exc:
        return None, f"unreadable manifest: {exc}"
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else manifest
        return None, f"manifest format {found!r}, expected {MANIFEST_FORMAT}"
    if key is not None and manifest.get("key") != key:
        return None, "manifest key does not match the folder"
    try:
        cubin = (path / manifest["cubin"]).read_bytes()
    except (OSError, KeyError, TypeError) as exc:
        return None, f"cubin unreadable: {exc}"
    if len(cubin) != manifest.get("cubin_size") or _sha256(cubin) != manifest.get("cubin_sha256"):
        return None, "cubin does not match its digest (truncated or corrupt)"
    if deep and path.name != f"{manifest.get('uri')}-{str(manifest.get('key'))[:16]}":
        return None, "manifest names another entry than its folder"
    files = manifest.get("files", {})
    if deep and not (isinstance(files, dict) and all(isinstance(v, list) and len(v) == 2 for v in files.values())):
        return None, "manifest: 'files' is not a map of name -> [size, sha256]"
    for name, (size, digest) in sorted(files.items()) if deep else ():
        try:
            data = (path / name).read_bytes()
        except OSError as exc:
            return None, f"{name} unreadable: {exc.strerror or exc}"
        if len(data) != size or _sha256(data) != digest:
            return None, f"{name} does not match its digest (truncated or corrupt)"
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

    def _lock_file(self, arch: str, entry_name: str) -> Path:
        return self.root / arch / f".{entry_name}.lock"

    @contextlib.contextmanager
    def lock(self, arch: str, uri: str, key: str):
        """Hold the entry's file lock (blocking); ``CacheError`` if the cache cannot be written."""
        path = self._lock_file(arch, self.entry_name(uri, key))
        lock = filelock.FileLock(str(path))
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            lock.acquire()
        except OSError as exc:
            raise _unwritable(self.root, path, exc) from exc
        try:
            yield lock
        finally:
            lock.release()

    def new_build_dir(self, arch: str, uri: str, key: str) -> Path:
        """A fresh folder on the cache's filesystem to build in (so publishing is one rename). Call with the
        entry's lock held: it first sweeps the build folders of builders that are gone."""
        name = self.entry_name(uri, key)
        self.sweep_build_dirs(arch, own_entry=name)
        path = self.root / arch / BUILD_DIRS / f"{name}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        try:
            path.mkdir(parents=True)
        except OSError as exc:
            raise _unwritable(self.root, path, exc) from exc
        return path

    def build_dirs(self, arch: str | None = None) -> list[Path]:
        """Every build folder of the writable root (of one arch, or of all)."""
        arches = [self.root / arch] if arch else (list(self.root.iterdir()) if self.root.is_dir() else [])
        tmps = [a / BUILD_DIRS for a in arches if (a / BUILD_DIRS).is_dir()]
        return sorted(p for tmp in tmps for p in tmp.iterdir() if not p.name.startswith("."))

    def _remove_if_unlocked(self, path: Path, arch: str, entry_name: str) -> bool:
        """Remove ``path`` (an entry or a build folder) while holding ``entry_name``'s lock, if that lock is
        free now; True if removed."""
        lock = filelock.FileLock(str(self._lock_file(arch, entry_name)), timeout=0)
        try:
            lock.acquire()
        except (filelock.Timeout, OSError):
            return False  # held: a build of this entry runs (or the cache is not writable)
        try:
            self._discard(path)
        finally:
            lock.release()
        return not path.exists()

    def sweep_build_dirs(self, arch: str | None = None, own_entry: str | None = None,
                         live_builders_too: bool = False) -> list[Path]:
        """Remove build folders nobody builds in; return them. A folder is kept while its entry's lock is held.
        Unless ``live_builders_too``, it is also kept while the process that made it runs and it is under
        ``STALE_BUILD_SECONDS`` old (a failed build's source stays for its error message). ``own_entry``: the
        entry whose lock the caller holds, so that no other builder uses that entry's folders."""
        removed = []
        for path in self.build_dirs(arch):
            entry_name, pid = _build_dir_owner(path)
            if entry_name == own_entry:
                self._discard(path)
                gone = not path.exists()
            elif not live_builders_too and _young(path) and _process_runs(pid):
                continue
            else:
                gone = self._remove_if_unlocked(path, path.parent.parent.name, entry_name)
            if gone:
                removed.append(path)
        return removed

    def publish(self, build_dir: Path, arch: str, uri: str, key: str, manifest: dict, cubin_name: str) -> Entry:
        """Write the manifest into ``build_dir`` and move it into place. Call with the entry's lock held."""
        cubin = (build_dir / cubin_name).read_bytes()
        files = {f.name: f.read_bytes() for f in sorted(build_dir.iterdir()) if f.is_file() and f.name[0] != "."}
        manifest = {
            **manifest,
            "files": {name: [len(data), _sha256(data)] for name, data in files.items() if name != cubin_name},
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
            self._discard(final)
        os.rename(build_dir, final)
        return Entry(final, manifest, cubin)

    @staticmethod
    def _discard(path: Path) -> None:
        """Move ``path`` out of the readers' way in one rename, then delete it (already gone is fine)."""
        trash = path.with_name(f".trash-{path.name}-{uuid.uuid4().hex[:8]}")
        try:
            os.rename(path, trash)
        except FileNotFoundError:
            return
        shutil.rmtree(trash, ignore_errors=True)

    # ------------------------------------------------------------------------------------------ maintenance

    def entry_dirs(self, root: Path | None = None) -> list[Path]:
        base = root or self.root
        if not base.is_dir():
            return []
        return sorted(p for arch in base.iterdir() if arch.is_dir() for p in arch.iterdir()
                      if p.is_dir() and not p.name.startswith("."))

    def verify(self) -> list[tuple[Path, str]]:
        """(folder, problem) for every unsound entry of the writable root (every file checked)."""
        return [(p, problem) for p in self.entry_dirs() for _, problem in [read_entry(p, deep=True)] if problem]

    def size_bytes(self) -> int:
        if not self.root.is_dir():
            return 0
        return sum(f.stat().st_size for f in self.root.rglob("*") if f.is_file())

    def clean(self, only_corrupt: bool = False) -> list[Path]:
        """Remove entries (all, or only unsound ones) and the build folders nobody builds in; return what
        went. An entry being rebuilt (its lock held) and a running build's folder are left alone."""
        doomed = [p for p, _ in self.verify()] if only_corrupt else self.entry_dirs()
        removed = []
        for path in doomed:
            if self._remove_if_unlocked(path, path.parent.name, path.name):
                removed.append(path)
        if self.root.is_dir():  # leftovers of a process killed while it discarded something
            for trash in (*self.root.glob("*/.trash-*"), *self.root.glob(f"*/{BUILD_DIRS}/.trash-*")):
                shutil.rmtree(trash, ignore_errors=True)
        return removed + self.sweep_build_dirs(live_builders_too=True)


def _build_dir_owner(path: Path) -> tuple[str, int | None]:
    """(entry name, builder pid) of a build folder named ``<entry>.<pid>.<random>``."""
    head, _, _random = path.name.rpartition(".")
    entry_name, _, pid = head.rpartition(".")
    return (entry_name, int(pid)) if entry_name and pid.isdigit() else (path.name, None)


def _process_runs(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by someone else
        return True
    return True


def _young(path: Path) -> bool:
    try:
        return time.time() - path.stat().st_mtime < STALE_BUILD_SECONDS
    except OSError:
        return False
