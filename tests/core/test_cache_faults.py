"""The kernel cache under faults: concurrent builders, builders and lock holders killed with SIGKILL, a clean
during a build, a corrupt file of each kind in an entry, unwritable cache folders, no nvcc.

Builders run in forked processes (a fresh interpreter would spend seconds importing torch); the kernel is
the smallest one (merge_states), and an entry that a test only needs present is copied from the session's
shared cache instead of being compiled again."""

from __future__ import annotations

import errno
import json
import multiprocessing
import os
import signal
import time
from pathlib import Path

import pytest

from compile_checks import prefetch, seed
from flashgen import cli, jit
from flashgen.cache import CacheError, CacheStore, read_entry
from flashgen.compile import ToolchainError, toolchain
from flashgen.spec import MergeSpec

OP, ARCH = "merge_states", "sm_90a"
SPEC = MergeSpec("float16")
OTHER = MergeSpec("bfloat16")  # a kernel the test's cache does not have
SPECS = [MergeSpec(d) for d in ("float16", "bfloat16", "float32")]
NO_PID = 4194305  # above Linux's largest pid_max: never a running process
fork = multiprocessing.get_context("fork")
prefetch(__name__, [(OP, SPEC, ARCH)])


@pytest.fixture
def shipped(cache_dir, kernel_cache):
    """The test's private cache holding SPEC's entry (compiled once per session)."""
    (entry,) = seed(cache_dir, kernel_cache, [(OP, SPEC, ARCH)])
    return entry


def _builder(cache: Path, specs: list, results, started=None, go=None, own_session: bool = False) -> None:
    """A builder process: ensure_compiled each spec into ``cache``; puts (its compiles, entry paths) on
    ``results``. With ``started``, it sets the event when its build folder is ready and ninja is about to run,
    then waits for ``go`` (if given)."""
    if own_session:
        os.setsid()  # so that killpg reaches ninja and nvcc too
    os.environ["FLASHGEN_CACHE_DIR"] = str(cache)
    if started is not None:
        run_ninja = jit.run_ninja

        def paused(build_dir, uri):
            started.set()
            if go is not None:
                go.wait(120)
            run_ninja(build_dir, uri)

        jit.run_ninja = paused
    before = jit.stats["compiles"]
    paths = [str(jit.ensure_compiled(spec, OP, ARCH).path) for spec in specs]
    results.put((jit.stats["compiles"] - before, paths))


def _lock_holder(cache: Path, ready) -> None:
    """Hold SPEC's entry lock with a build folder made, as a builder does, until killed."""
    store = CacheStore(cache)
    req = jit.prepare(SPEC, OP, ARCH)
    with store.lock(ARCH, req.uri, req.key):
        store.new_build_dir(ARCH, req.uri, req.key)
        ready.set()
        time.sleep(600)


def _start(target, *args):
    proc = fork.Process(target=target, args=args)
    proc.start()
    return proc


@pytest.mark.nvcc
def test_concurrent_builders_compile_each_kernel_once(cache_dir):
    """Four processes at once: three want all three kernels (each in another order), one wants the first only."""
    results = fork.SimpleQueue()
    orders = [SPECS[i:] + SPECS[:i] for i in range(3)] + [SPECS[:1]]
    procs = [_start(_builder, cache_dir, order, results) for order in orders]
    for proc in procs:
        proc.join(300)
    assert [proc.exitcode for proc in procs] == [0] * len(procs)
    outs = [results.get() for _ in procs]
    assert sum(compiles for compiles, _ in outs) == len(SPECS)  # each kernel compiled by exactly one process
    assert len({path for _, paths in outs for path in paths}) == len(SPECS)
    store = CacheStore(cache_dir)
    assert len(store.entry_dirs()) == len(SPECS) and store.verify() == []
    assert store.build_dirs() == []  # no leftover build folders


@pytest.mark.nvcc
def test_clean_during_a_build_leaves_the_build_alone(cache_dir):
    started, go, results = fork.Event(), fork.Event(), fork.SimpleQueue()
    proc = _start(_builder, cache_dir, [SPEC], results, started, go)
    store = CacheStore(cache_dir)
    try:
        assert started.wait(120)
        (build_dir,) = store.build_dirs()
        assert store.clean(only_corrupt=True) == [] and store.clean() == []
        assert (build_dir / "kernel.cu").is_file() and (build_dir / "build.ninja").is_file()
    finally:
        go.set()
        proc.join(300)
    assert proc.exitcode == 0
    compiles, (path,) = results.get()
    assert compiles == 1 and read_entry(Path(path), deep=True)[0] is not None
    assert store.build_dirs() == []


@pytest.mark.nvcc
def test_a_builder_killed_mid_compile_does_not_stop_the_next(cache_dir):
    started, results = fork.Event(), fork.SimpleQueue()
    proc = _start(_builder, cache_dir, [SPEC], results, started, None, True)
    assert started.wait(120)
    time.sleep(0.3)  # ninja and nvcc are running
    os.killpg(proc.pid, signal.SIGKILL)
    proc.join(60)
    store = CacheStore(cache_dir)
    (left,) = store.build_dirs()
    before = jit.stats["compiles"]
    entry = jit.ensure_compiled(SPEC, OP, ARCH)
    assert jit.stats["compiles"] == before + 1 and read_entry(entry.path, deep=True)[0] is not None
    assert not left.exists() and store.build_dirs() == []  # the dead builder's folder was swept


@pytest.mark.nvcc
def test_a_killed_lock_holder_frees_its_entry(cache_dir):
    ready = fork.Event()
    proc = _start(_lock_holder, cache_dir, ready)
    store = CacheStore(cache_dir)
    try:
        assert ready.wait(120)
        (held,) = store.build_dirs()
        assert store.clean() == [] and held.is_dir()  # its lock is held: a build runs there
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(60)
    entry = jit.ensure_compiled(SPEC, OP, ARCH)  # the lock died with its holder
    assert read_entry(entry.path)[0] is not None and not held.exists()


def test_build_folders_are_removed_once_nobody_builds_in_them(tmp_path):
    store = CacheStore(tmp_path)
    tmp = tmp_path / ARCH / ".tmp"
    crashed = tmp / f"merge_states_f16-{'a' * 16}.{NO_PID}.0a1b2c3d"  # its process is gone
    failed = tmp / f"merge_states_bf16-{'b' * 16}.{os.getpid()}.0a1b2c3d"  # a failed build of a running process
    stale = tmp / f"merge_states_bf16-{'b' * 16}.{os.getpid()}.4e5f6a7b"  # the same, over an hour old
    for path in (crashed, failed, stale):
        path.mkdir(parents=True)
    os.utime(stale, (time.time() - 7200,) * 2)
    with store.lock(ARCH, "merge_states_f32", "c" * 64):
        mine = store.new_build_dir(ARCH, "merge_states_f32", "c" * 64)  # a new build sweeps first
        assert sorted(store.build_dirs()) == sorted([failed, mine])
        assert store.clean() == [failed]  # its entry's lock is held: mine stays
    assert store.clean() == [mine] and store.build_dirs() == []


CORRUPTIONS = {  # name -> (file, how, whether a lookup (which loads only the cubin) sees it)
    "truncated cubin": ("kernel.cubin", lambda p: p.write_bytes(p.read_bytes()[:100]), True),
    "one cubin byte flipped": ("kernel.cubin", lambda p: p.write_bytes(_flip(p.read_bytes())), True),
    "missing cubin": ("kernel.cubin", Path.unlink, True),
    "manifest not json": ("manifest.json", lambda p: p.write_text('{"format": 1, "cubin": '), True),
    "manifest of another key": ("manifest.json", lambda p: _edit(p, key="0" * 64), True),
    "manifest of another format": ("manifest.json", lambda p: _edit(p, format=0), True),
    "manifest not a map": ("manifest.json", lambda p: p.write_text("[1]"), True),
    "missing manifest": ("manifest.json", Path.unlink, True),
    "truncated source": ("kernel.cu", lambda p: p.write_text(p.read_text()[:10]), False),
    "edited resource report": ("ptxas.log", lambda p: p.write_text(p.read_text().replace("Used", "Usde")), False),
    "edited build.ninja": ("build.ninja", lambda p: p.write_text(p.read_text() + "\n"), False),
    "missing ptxas log": ("ptxas.log", Path.unlink, False),
}


def _flip(data: bytes) -> bytes:
    return data[:200] + bytes([data[200] ^ 1]) + data[201:]


def _edit(path: Path, **changes) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


@pytest.mark.nvcc
@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_a_corrupt_file_is_detected(cache_dir, shipped, corruption):
    name, corrupt, seen_by_lookup = CORRUPTIONS[corruption]
    corrupt(shipped.path / name)
    store = CacheStore(cache_dir)
    (bad, problem), = store.verify()
    assert bad == shipped.path and problem, problem
    key = shipped.manifest["key"]
    assert (store.lookup(ARCH, shipped.uri, key) is None) == seen_by_lookup
    assert store.clean(only_corrupt=True) == [shipped.path] and store.entry_dirs() == []


@pytest.mark.nvcc
def test_a_corrupt_manifest_is_rebuilt(cache_dir, shipped):
    (shipped.path / "manifest.json").write_text("{")
    before = jit.stats["compiles"]
    rebuilt = jit.ensure_compiled(SPEC, OP, ARCH)
    assert jit.stats["compiles"] == before + 1
    assert rebuilt.path == shipped.path and read_entry(rebuilt.path, deep=True)[0] is not None
    assert rebuilt.cubin == shipped.cubin and CacheStore(cache_dir).build_dirs() == []


def _deny_writes(monkeypatch, root: Path) -> None:
    """Writes under ``root`` fail as on a read-only mount: chmod does not stop root, who runs CI containers."""
    real_open, real_mkdir = os.open, os.mkdir
    prefix = str(root) + os.sep

    def check(path) -> None:
        text = os.fspath(path)
        if isinstance(text, str) and (text + os.sep).startswith(prefix):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), text)

    def open_(path, flags, *args, **kwargs):
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            check(path)
        return real_open(path, flags, *args, **kwargs)

    def mkdir(path, *args, **kwargs):
        check(path)
        return real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_)
    monkeypatch.setattr(os, "mkdir", mkdir)


def _plan(tmp_path: Path, spec: MergeSpec) -> str:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps([{"op": OP, "spec": {"type": "MergeSpec", "dtype": spec.dtype}}]))
    return str(path)


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.mark.nvcc
@pytest.mark.parametrize("how", ["read-only mount", "chmod"])
def test_a_read_only_cache_serves_its_kernels_and_refuses_a_miss(tmp_path, cache_dir, shipped, monkeypatch, capsys,
                                                                 how):
    folders = (cache_dir, cache_dir / ARCH, shipped.path)
    if how == "chmod":
        if os.geteuid() == 0:
            pytest.skip("root writes through chmod (the read-only mount case covers root)")
        for folder in folders:
            folder.chmod(0o555)
    else:
        _deny_writes(monkeypatch, cache_dir)
    try:
        before = jit.stats["compiles"]
        assert jit.ensure_compiled(SPEC, OP, ARCH).path == shipped.path  # an AOT deployment keeps loading
        assert jit.stats["compiles"] == before
        with pytest.raises(CacheError, match=rf"kernel cache {cache_dir} cannot be written: it is read-only .*"
                                             "set FLASHGEN_CACHE_DIR to a writable folder"):
            jit.ensure_compiled(OTHER, OP, ARCH)
        assert cli.main(["build", "--arch", ARCH, "--plan", _plan(tmp_path, OTHER)]) == 1
        assert f"flashgen build: kernel cache {cache_dir} cannot be written" in _one_line_error(capsys)
    finally:
        for folder in folders:
            folder.chmod(0o755)


@pytest.mark.nvcc
@pytest.mark.parametrize("below", [False, True], ids=["the file", "a folder below it"])
def test_a_cache_folder_that_is_a_file_is_a_clear_error(tmp_path, cache_dir, monkeypatch, capsys, below):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(blocker / "cache" if below else blocker))
    with pytest.raises(CacheError, match=rf"{blocker} is not a folder; set FLASHGEN_CACHE_DIR to a writable folder"):
        jit.ensure_compiled(SPEC, OP, ARCH)
    assert cli.main(["build", "--arch", ARCH, "--plan", _plan(tmp_path, SPEC)]) == 1
    assert f"{blocker} is not a folder" in _one_line_error(capsys)


@pytest.mark.nvcc
def test_without_nvcc_a_cached_kernel_loads_and_a_miss_says_why(tmp_path, cache_dir, shipped, monkeypatch):
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setattr(toolchain, "_candidates", lambda: [tmp_path / "no" / "nvcc"])
    assert jit.ensure_compiled(SPEC, OP, ARCH).path == shipped.path  # found by its content key
    with pytest.raises(ToolchainError, match="nvcc not found"):
        jit.ensure_compiled(OTHER, OP, ARCH)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))  # a folder without bin/nvcc
    assert jit.ensure_compiled(SPEC, OP, ARCH).path == shipped.path
    with pytest.raises(ToolchainError, match=f"CUDA_HOME={tmp_path} has no nvcc: looked for {tmp_path}/bin/nvcc"):
        jit.ensure_compiled(OTHER, OP, ARCH)
