"""Build and load the native planner (``flashgen/plan/native/planner.cpp``, a CPython extension) through the kernel
cache: the build-and-load step of host code, beside ``jit`` (kernels). Importing it registers ``ensure_built`` as
``flashgen.plan.native``'s loader (``flashgen`` imports it), so the planner package imports nothing but its own.

The contract, in one place: the module is compiled once per (source, C++ compiler, Python ABI, flashgen
version, flags) with the host C++ compiler (``c++``, else ``g++``, on PATH) into the cache as an entry
``<cache>/host/planner-<hash16>/`` (the shared object, its source and a manifest whose digest every load
checks). A lookup searches the read-only extra caches first (an AOT deployment's, built by ``flashgen build``),
then the writable one; a miss takes the entry's file lock, looks again (another process may have built it
meanwhile), compiles in a build folder and publishes it with one rename (``flashgen.cache.CacheStore``). Without
a compiler, any entry built from the same source for the same Python and flashgen loads (``content_key``), so
a deployment needs none; ``FLASHGEN_DISABLE_JIT=1`` never compiles. A corrupt entry (a digest that does not
match, a shared object that does not load) counts as a miss and is rebuilt. Every failure is a
``NativeBuildError`` saying why: the planner then runs its Python list paths (``flashgen.plan.native``).

The compile takes ~1-3 s (one source file, -O2), once per cache.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

from .plan import native
from .plan.native import NativeBuildError

SOURCE = Path(__file__).parent / "plan" / "native" / "planner.cpp"
MODULE = "flashgen_planner"  # the extension's name: its PyInit_flashgen_planner
SHARED_OBJECT = "planner.so"
ARCH, URI = "host", "planner"  # the entry's folder in the cache: <cache>/host/planner-<hash16>/
COMPILERS = ("c++", "g++")  # looked up on PATH, in this order (a path is taken as it is)
FLAGS = ("-O2", "-shared", "-fPIC", "-std=c++17", "-ffp-contract=off")
COMPILE_TIMEOUT = 300  # seconds


def find_compiler() -> str:
    """The host C++ compiler's path (the first of ``COMPILERS`` found), or ``NativeBuildError``."""
    for name in COMPILERS:
        path = shutil.which(name)
        if path:
            return path
    raise NativeBuildError(f"no C++ compiler: looked for {', '.join(COMPILERS)} on PATH")


def compiler_banner(path: str) -> str:
    """``<path> --version``'s output, which the key hashes (a new compiler builds anew)."""
    try:
        done = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60, check=True)
    except (OSError, subprocess.SubprocessError) as exc:
        raise NativeBuildError(f"the C++ compiler {path} does not run: {exc}") from exc
    return done.stdout.strip()


def python_abi() -> str:
    """What a compiled extension depends on of this Python: its implementation, version and ABI tag."""
    return f"{sys.implementation.cache_tag} {sysconfig.get_config_var('EXT_SUFFIX')} {sys.abiflags}"


def _digest(*items: tuple[str, bytes]) -> str:
    # labelled, length-prefixed fields, as cache.key.kernel_key
    h = hashlib.blake2b(digest_size=32)
    for label, payload in items:
        h.update(len(label).to_bytes(8, "little") + label.encode() + len(payload).to_bytes(8, "little") + payload)
    return h.hexdigest()


def content_key(source: bytes) -> str:
    """The digest of what the module does and runs on: the source, the Python ABI, flashgen's version (what a
    deployment without a compiler matches)."""
    from flashgen._version import __version__

    return _digest(("format", b"flashgen-planner-1"), ("source", source), ("python_abi", python_abi().encode()),
                   ("flashgen_version", __version__.encode()))


def planner_key(source: bytes, banner: str) -> str:
    """The entry's key: ``content_key`` with the compiler's banner and the flags."""
    return _digest(("content_key", content_key(source).encode()), ("compiler", banner.encode()),
                   ("flags", "\0".join(FLAGS).encode()))


def default_store():
    """The writable cache and the read-only extra caches (``FLASHGEN_CACHE_DIR``, ``FLASHGEN_EXTRA_CACHE_DIRS``)."""
    from flashgen import knobs
    from flashgen.cache import CacheStore

    return CacheStore(knobs.cache_dir(), knobs.extra_cache_dirs())


def ensure_built(store=None):
    """``(entry, module)``: the cached planner, built on a miss; ``NativeBuildError`` saying why there is none.
    ``flashgen build`` calls it (an AOT cache holds the planner); plans load it through ``load``."""
    from flashgen import knobs
    from flashgen.cache import CacheError, read_entry

    store = store or default_store()
    source = SOURCE.read_bytes()
    try:
        compiler = find_compiler()
        key = planner_key(source, compiler_banner(compiler))
    except NativeBuildError as exc:
        entry = _lookup_by_content(store, content_key(source))  # an AOT cache: no compiler needed
        if entry is None:
            raise NativeBuildError(f"{exc}, and no cache holds a planner built from this source "
                                   f"(looked in {_roots(store)})") from None
        return entry, _load(entry)
    entry = store.lookup(ARCH, URI, key)
    if entry is not None:
        module = _try_load(entry)
        if module is not None:
            return entry, module
    if knobs.disable_jit():
        raise NativeBuildError(f"FLASHGEN_DISABLE_JIT=1 and no cache holds a loadable planner for this source and "
                               f"compiler (looked in {_roots(store)})")
    try:
        with store.lock(ARCH, URI, key):
            # built by another process while we waited? (the writable cache's: a read-only one's that did not
            # load is passed over, not rebuilt by every process)
            entry, _ = read_entry(store.entry_dir(ARCH, URI, key), key)
            module = None if entry is None else _try_load(entry)
            if module is None:
                entry = _compile(store, key, source, compiler)
                module = _load(entry)
    except CacheError as exc:
        raise NativeBuildError(str(exc)) from None
    return entry, module


def _roots(store) -> str:
    return ", ".join(str(root) for root in (*store.extra_roots, store.root))


def _lookup_by_content(store, key: str):
    from flashgen.cache import read_entry

    for root in (*store.extra_roots, store.root):
        for path in sorted((root / ARCH).glob(f"{URI}-*")):
            entry, _ = read_entry(path)
            if entry is not None and entry.manifest.get("content_key") == key:
                return entry
    return None


def _compile(store, key: str, source: bytes, compiler: str):
    include = Path(sysconfig.get_paths()["include"])
    if not (include / "Python.h").is_file():
        raise NativeBuildError(f"no Python.h in {include}: install this Python's development headers")
    build_dir = store.new_build_dir(ARCH, URI, key)
    (build_dir / SOURCE.name).write_bytes(source)
    command = [compiler, *FLAGS, f"-I{include}", SOURCE.name, "-o", SHARED_OBJECT]
    start = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=build_dir, capture_output=True, text=True, timeout=COMPILE_TIMEOUT)
    except (OSError, subprocess.SubprocessError) as exc:
        raise NativeBuildError(f"{' '.join(command)} did not run: {exc}") from exc
    if done.returncode != 0:
        raise NativeBuildError(f"{' '.join(command)} failed in {build_dir} (exit {done.returncode}):\n"
                               f"{(done.stderr or done.stdout).strip()[-4000:]}")
    manifest = {"content_key": content_key(source), "compiler": compiler, "flags": list(FLAGS),
                "python_abi": python_abi(), "compile_seconds": round(time.perf_counter() - start, 3),
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    return store.publish(build_dir, ARCH, URI, key, manifest, SHARED_OBJECT)


def _load(entry):
    """The module of a verified entry, or ``NativeBuildError``."""
    path = entry.path / entry.manifest["cubin"]
    try:
        loader = importlib.machinery.ExtensionFileLoader(MODULE, str(path))
        spec = importlib.util.spec_from_file_location(MODULE, path, loader=loader)
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - ImportError, or whatever the module's init raised
        raise NativeBuildError(f"{path} does not load: {exc}") from exc
    if not (callable(getattr(module, "prefill", None)) and callable(getattr(module, "decode", None))):
        raise NativeBuildError(f"{path} is not flashgen's planner (no prefill and decode)")
    return module


def _try_load(entry):
    try:
        return _load(entry)
    except NativeBuildError:
        return None  # rebuilt (into the writable cache) by the caller


native.set_loader(ensure_built)
