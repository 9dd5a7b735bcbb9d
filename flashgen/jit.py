"""Build-and-load: the one place that composes kernels, cache, compile and runtime.

Contract of ``build(spec, op, options=None)``:
1. In-process fast path: a dict keyed by (op, spec, options, arch, device) returns the loaded ``Kernel`` (µs).
2. The lookup index (``flashgen.cache.index``): what decides the render (op, projected spec, options, arch,
   flashgen version, the digest of the templates and the code generator) -> an entry whose content key it
   checks. A hit loads the cubin without rendering or running nvcc (one index file and one manifest read).
   On a miss, render the source from the spec and compute the content key (sources, header tree, nvcc version, arch,
   flags, flashgen version). Look the key up in the read-only extra caches, then the writable cache; a
   sound entry is loaded without taking a lock.
3. On a miss: if ``FLASHGEN_DISABLE_JIT=1`` raise ``MissingKernelError`` naming the spec. Otherwise take the
   entry's file lock, look again (another process may have built it meanwhile), compile with ninja + nvcc
   into a temporary folder and publish it atomically; then load it. The loaded ``Kernel`` carries the family's
   ``LaunchConfig`` (``kernel.launch_config``: block, shared memory, tiles), and every entry point's maximum
   dynamic shared memory is set to its ``smem_bytes``. A cache folder that cannot be written raises
   ``CacheError`` (naming the folder and the fix); a read-only one that holds the kernel still serves it.
4. Without a GPU nothing can be loaded: ``build`` compiles for the target arch if one is set, then raises
   ``NoDeviceError``; ``ensure_compiled`` is the compile-only call.
Without nvcc, kernels already in a cache (an AOT cache shipped with a deployment) are still found: they
are matched by their content key, which leaves the compiler out.
"""

from __future__ import annotations

import functools
import hashlib
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

from . import knobs
from ._version import __version__
from .cache import CacheStore, Entry, KeyInputs, index, kernel_key, read_entry, read_header_tree
from .kernels import EntryPoint, KernelFamily, LaunchConfig, family, include_dir
from .compile import (CUBIN, SOURCE, ToolchainError, choose_arch, device_arch, find_nvcc, nvcc_flags, nvcc_identity,
                      run_ninja, write_build_ninja, write_source)
from .spec.serialize import spec_to_dict


class MissingKernelError(RuntimeError):
    """JIT is disabled (``FLASHGEN_DISABLE_JIT=1``) and the kernel is in no cache."""


class NoDeviceError(RuntimeError):
    """``build`` found no GPU to load the kernel on. ``entry``: the cache entry it compiled (or found) for the
    target arch, None when no arch was given to compile for."""

    def __init__(self, message: str, entry: Entry | None = None):
        super().__init__(message)
        self.entry = entry


# counts real compiles in this process: a warm call must leave it unchanged
stats = {"compiles": 0}


@dataclass(frozen=True)
class BuildRequest:
    """Everything needed to look up or compile one kernel."""

    op: str
    spec: object  # the family's projected spec
    uri: str
    arch: str
    source: str
    entry_points: tuple[EntryPoint, ...]
    launch: LaunchConfig
    content_key: str  # sources + headers + arch + flashgen version (no compiler)
    key: str | None  # content + nvcc version + flags; None when no nvcc is available


@functools.lru_cache(maxsize=4)
def _header_tree(path: str) -> dict[str, bytes]:
    return read_header_tree(Path(path))


# what renders a kernel besides the spec: the templates (and headers), the families and the spec types
_CODEGEN_DIRS = (Path(__file__).parent / "kernels", Path(__file__).parent / "spec")


def _source_files(templates: str) -> list[tuple[str, str, os.stat_result]]:
    """(name, path, stat) of every file that renders a kernel (os.walk, not pathlib: this runs on every
    process's first load, and is cheaper so)."""
    found = []
    for base in (templates, *map(str, _CODEGEN_DIRS)):
        label = os.path.basename(base)
        for folder, dirs, names in os.walk(base):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for name in sorted(names):
                path = os.path.join(folder, name)
                found.append((f"{label}/{os.path.relpath(path, base)}", path, os.stat(path)))
    return found


def sources_digest() -> str:
    """A digest of every file that renders a kernel (templates, headers, ``flashgen/kernels``,
    ``flashgen/spec``): the lookup index keys by it, so an edit in a development checkout misses the index.
    Reading and hashing them all takes ~5 ms, so the digest is kept in the writable cache under a name made of
    the files' paths, sizes, inodes and change times (a stat each; any write changes a change time)."""
    return _sources_digest(str(include_dir().parent), str(knobs.cache_dir()))


@functools.lru_cache(maxsize=4)
def _sources_digest(templates: str, cache: str) -> str:
    files = _source_files(templates)
    stamp = hashlib.blake2b(digest_size=16)
    for name, _, st in files:
        stamp.update(f"{name}\0{st.st_size}\0{st.st_ino}\0{st.st_mtime_ns}\0{st.st_ctime_ns}\n".encode())
    memo = Path(cache) / index.INDEX_DIR / f"sources-{stamp.hexdigest()}"
    try:
        digest = memo.read_text()
        if len(digest) == 64:
            return digest
    except (OSError, UnicodeDecodeError):
        pass
    h = hashlib.blake2b(digest_size=32)
    for name, path, _ in files:
        with open(path, "rb") as f:
            data = f.read()
        h.update(len(name).to_bytes(8, "little") + name.encode() + len(data).to_bytes(8, "little") + data)
    index.write_atomic(memo, h.hexdigest())
    return h.hexdigest()


@dataclass(frozen=True)
class IndexedLookup:
    """The lookup index's answer for (spec, op, options, arch): the family, the projected spec, the index key,
    and the entry on a hit (None on a miss)."""

    fam: KernelFamily
    spec: object
    arch: str
    key: str
    entry: Entry | None


def lookup_indexed(spec: object, op: str, store: CacheStore, arch: str | None = None, device: int | None = None,
                   options: dict | None = None) -> IndexedLookup:
    """The entry the lookup index of any root records for (spec, op), without rendering (see the module doc)."""
    fam = family(op, options)
    projected = fam.project(spec)
    arch = choose_arch(arch, device)
    key = index.lookup_key(op, spec_to_dict(projected), fam.options, arch, __version__, sources_digest())
    toolchain = nvcc_identity()
    for root in (*store.extra_roots, store.root):
        entry = index.lookup(root, arch, key, toolchain)
        if entry is not None:
            return IndexedLookup(fam, projected, arch, key, entry)
    return IndexedLookup(fam, projected, arch, key, None)


def render(spec: object, op: str, options: dict | None = None) -> str:
    """The CUDA source that ``build(spec, op, options=options)`` would compile."""
    return family(op, options).render(spec)


def prepare(spec: object, op: str, arch: str | None = None, device: int | None = None,
            options: dict | None = None) -> BuildRequest:
    """Render and key (spec, op) for ``arch`` (default: ``FLASHGEN_CUDA_ARCH``, else ``device``'s arch);
    ``options``: the family's kernel options (they enter its uri)."""
    fam = family(op, options)
    projected = fam.project(spec)
    arch = choose_arch(arch, device)
    source = fam.render(projected)
    headers = _header_tree(str(include_dir()))
    content = KeyInputs({SOURCE: source}, headers, "", arch, (), __version__)
    try:
        nvcc = find_nvcc()
        full = KeyInputs({SOURCE: source}, headers, nvcc.banner, arch, tuple(nvcc_flags(arch)), __version__)
        key = kernel_key(full)
    except ToolchainError:
        key = None
    return BuildRequest(op, projected, fam.uri(projected), arch, source, fam.entry_points(projected),
                        fam.launch(projected), kernel_key(content), key)


def default_store() -> CacheStore:
    return CacheStore(knobs.cache_dir(), knobs.extra_cache_dirs())


def _lookup_by_content(store: CacheStore, req: BuildRequest) -> Entry | None:
    for root in (*store.extra_roots, store.root):
        for path in sorted((root / req.arch).glob(f"{req.uri}-*")):
            entry, _ = read_entry(path)
            if entry is not None and entry.manifest.get("content_key") == req.content_key:
                return entry
    return None


def _compile(store: CacheStore, req: BuildRequest) -> Entry:
    nvcc = find_nvcc()  # raises ToolchainError with a clear message when absent
    build_dir = store.new_build_dir(req.arch, req.uri, req.key)
    write_source(build_dir, req.source)
    write_build_ninja(build_dir, nvcc, req.arch, include_dir())
    start = time.perf_counter()
    run_ninja(build_dir, req.uri)
    stats["compiles"] += 1
    manifest = {
        "op": req.op,
        "content_key": req.content_key,
        "nvcc_version": nvcc.version,
        "flags": nvcc_flags(req.arch),
        "flashgen_version": __version__,
        "entry_points": [e.name for e in req.entry_points],
        "compile_seconds": round(time.perf_counter() - start, 3),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    return store.publish(build_dir, req.arch, req.uri, req.key, manifest, CUBIN)


def ensure_compiled(spec: object, op: str, arch: str | None = None, store: CacheStore | None = None,
                    options: dict | None = None) -> Entry:
    """The cache entry for (spec, op, arch), compiling it on a miss, without loading it: needs nvcc, not a
    GPU. This is the call for machines without one (an AOT build, a CI job); ``flashgen build`` uses it.
    ``arch``: the target (``"sm_90a"``), default ``FLASHGEN_CUDA_ARCH``, else the GPU's own. Raises
    ``ToolchainError`` without nvcc (unless the kernel is cached), ``CacheError`` when the cache cannot be
    written, ``MissingKernelError`` on a miss with ``FLASHGEN_DISABLE_JIT=1``.

    Example::

        entry = flashgen.ensure_compiled(MergeSpec("bfloat16"), "merge_states", arch="sm_90a")
        entry.path    # <cache>/sm_90a/merge_states_bf16-<hash16>/, holding kernel.cubin
    """
    store = store or default_store()
    hit = lookup_indexed(spec, op, store, arch, options=options)
    if hit.entry is not None:
        return hit.entry
    return _ensure(prepare(spec, op, arch, options=options), store, hit.key)


def _ensure(req: BuildRequest, store: CacheStore, index_key: str | None = None) -> Entry:
    entry = _ensure_unindexed(req, store)
    if index_key is not None and entry.path.parent.parent == store.root:
        index.record(store.root, req.arch, index_key, entry, nvcc_identity())
    return entry


def _ensure_unindexed(req: BuildRequest, store: CacheStore) -> Entry:
    if req.key is not None:
        entry = store.lookup(req.arch, req.uri, req.key)
    else:
        entry = _lookup_by_content(store, req)
    if entry is not None:
        return entry
    if knobs.disable_jit():
        raise MissingKernelError(
            f"kernel {req.uri} (op {req.op!r}, arch {req.arch}) is not in the cache and FLASHGEN_DISABLE_JIT=1; "
            f"spec: {req.spec!r}; looked in {', '.join(str(r) for r in (*store.extra_roots, store.root))}"
        )
    if req.key is None:
        find_nvcc()  # raises the ToolchainError that explains what is missing
    with store.lock(req.arch, req.uri, req.key):
        entry = store.lookup(req.arch, req.uri, req.key)  # built by another process while we waited?
        return entry if entry is not None else _compile(store, req)


@dataclass
class Kernel:
    """A loaded kernel module: its entry points by name, ready to launch, and how to launch them."""

    op: str
    uri: str
    arch: str
    device: int
    entry: Entry
    functions: dict = field(default_factory=dict)
    launch_config: LaunchConfig | None = None
    params: dict = field(default_factory=dict)  # entry point name -> its ParamsLayout (pack by name: ``bind``)

    def __getitem__(self, name: str):
        return self.functions[name]

    @property
    def path(self) -> Path:
        return self.entry.path

    @property
    def manifest(self) -> dict:
        return self.entry.manifest


_loaded: dict[tuple, Kernel] = {}
_load_lock = threading.Lock()


def build(spec: object, op: str, device: int | None = None, arch: str | None = None,
          options: dict | None = None) -> Kernel:
    """A loaded ``Kernel`` for (spec, op) on ``device`` (default: torch's current device); ``options``: the
    family's kernel options (``{"tiles": "kv32"}`` for ``prefill``), part of the kernel's uri and key.

    Without a GPU there is nothing to load on: given a target arch (``arch=`` or ``FLASHGEN_CUDA_ARCH``) it
    still compiles and caches the kernel, then raises ``NoDeviceError`` saying so (the entry in ``.entry``);
    ``ensure_compiled`` is the call that only compiles.

    Example::

        kernel = flashgen.build(MergeSpec("bfloat16"), "merge_states")
        kernel["merge_states"].launch(grid, kernel.launch_config.block, 0, stream, *params)
    """
    if device is None:
        device = _current_device()
    cache_key = (op, spec, tuple(sorted(options.items())) if options else (), arch, device)
    kernel = _loaded.get(cache_key)
    if kernel is not None:
        return kernel
    with _load_lock:
        kernel = _loaded.get(cache_key)
        if kernel is None:
            kernel = _load(spec, op, device, arch, options)
            _loaded[cache_key] = kernel
    return kernel


def _current_device() -> int | None:
    import torch

    try:
        return torch.cuda.current_device()
    except (AssertionError, RuntimeError):  # a CPU build of torch ("not compiled with CUDA"), or no GPU visible
        return None


def _no_device(spec: object, op: str, arch: str | None, options: dict | None) -> NoReturn:
    """Compile (spec, op) if a target arch is known, then raise ``NoDeviceError`` saying what happened."""
    if not (arch or knobs.cuda_arch()):
        raise NoDeviceError(
            f"no GPU is visible to load kernel {op!r} on, and no target arch is set to compile it for; "
            f"to compile without loading, call flashgen.ensure_compiled(spec, {op!r}, arch='sm_90a') "
            "(or set FLASHGEN_CUDA_ARCH)"
        )
    req = prepare(spec, op, arch, options=options)
    entry = _ensure(req, default_store())
    raise NoDeviceError(
        f"kernel {req.uri} is compiled for {req.arch} and cached at {entry.path}, but no GPU is visible to load "
        f"it on; flashgen.ensure_compiled(spec, {op!r}, arch={req.arch!r}) compiles without loading",
        entry,
    )


def _load(spec: object, op: str, device: int | None, arch: str | None, options: dict | None) -> Kernel:
    from .runtime import Module

    if device is None or device_arch(device) is None:
        _no_device(spec, op, arch, options)
    store = default_store()
    hit = lookup_indexed(spec, op, store, arch, device, options)
    if hit.entry is not None:  # no render, no nvcc
        entry, uri, entry_points, launch = hit.entry, hit.fam.uri(hit.spec), hit.fam.entry_points(hit.spec), \
            hit.fam.launch(hit.spec)
    else:
        req = prepare(spec, op, arch, device, options)
        entry, uri, entry_points, launch = _ensure(req, store, hit.key), req.uri, req.entry_points, req.launch
    module = Module(entry.cubin, device)
    functions = {e.name: module.function(e.name, e.params.format, e.params.size) for e in entry_points}
    if launch.smem_bytes:
        for function in functions.values():
            function.set_max_dynamic_shared_memory(launch.smem_bytes)
    return Kernel(op, uri, hit.arch, device, entry, functions, launch, {e.name: e.params for e in entry_points})
