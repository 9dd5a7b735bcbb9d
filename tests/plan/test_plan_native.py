"""The native planner (``flashgen.plan.native``, planner.cpp) plans what the Python list paths plan, byte for
byte: every schema field over its full length (padding included), the alignment gaps between fields, the whole
info tuple, and the same PlanError text, on thousands of seeded random small batches of every option. Then its
build: cached by key, loaded by a second process without compiling, rebuilt or passed over when corrupt, and
a warned fall back to the Python paths (the same plans) where no compiler is found."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from flashgen.cache import CacheStore, read_entry
from flashgen.plan import PlanError, fast_paths, heuristics, list_paths, native, plan_decode, plan_split_kv, split_kv
from flashgen import jit_native as build
from flashgen.plan.request import SplitKVInfo

REPO = Path(__file__).resolve().parents[2]
SENTINEL = -777  # what the host buffers hold before a plan: the two plans must write (and skip) the same places
BUFFER = 1 << 16


@pytest.fixture(scope="module")
def module():
    """The native module (the session's: tests/conftest.py loads it once)."""
    loaded = native.planner()
    if loaded is None:
        if shutil.which("c++") or shutil.which("g++"):
            pytest.fail(f"the native planner did not load: {native.failure()}")
        pytest.skip("no C++ compiler")
    return loaded


def test_its_constants_are_the_python_paths(module):
    assert (module.SMALL_BATCH, module.SMALL_DECODE, module.SMALL_ITEMS, module.SMALL_SPLIT_ITEMS) == (
        list_paths.SMALL_BATCH, list_paths.SMALL_DECODE, list_paths._SMALL_ITEMS, list_paths._SMALL_SPLIT_ITEMS)
    assert (module.INT32_LIMIT, module.MAX_KV_LEN) == (fast_paths.INT32_LIMIT, fast_paths.MAX_KV_LEN)
    assert module.ALONE_SPEEDUP == heuristics.ALONE_SPEEDUP and module.ALIGN == 4


class Twin:
    """Plans a call both ways (native first, then the Python paths) into sentinel-filled buffers."""

    def __init__(self, module):
        self.module = module
        self.buffers = [torch.empty(BUFFER, dtype=torch.int32) for _ in range(2)]
        self.native_plans = 0

    def run(self, planner, *args, **options):
        results = []
        for buffer, enabled in zip(self.buffers, (True, False)):
            buffer.numpy().fill(SENTINEL)
            with native.use(enabled):
                try:
                    plan = planner(*args, host_buffer=buffer, **options)
                except PlanError as error:
                    results.append(str(error))
                    continue
            results.append((plan.info, dict(plan.schema), plan.numel, buffer.numpy().copy()))
        return results

    def check(self, planner, *args, **options):
        """The info of both plans, once they are found equal (None for the same PlanError)."""
        (native_plan, python_plan) = self.run(planner, *args, **options)
        if isinstance(python_plan, str) or isinstance(native_plan, str):
            assert native_plan == python_plan, (args, options)
            return None
        assert native_plan[:3] == python_plan[:3], (args, options)
        same = native_plan[3] == python_plan[3]
        if not same.all():
            at = np.flatnonzero(~same)[:12]
            fields = {name: f for name, f in python_plan[1].items() if f.offset <= at[0] < f.offset + f.length}
            raise AssertionError(f"{args} {options}: the buffers differ at {at.tolist()} ({fields}): native "
                                 f"{native_plan[3][at].tolist()}, python {python_plan[3][at].tolist()}")
        return python_plan[0]

    def count(self, call, batch: tuple, options: tuple) -> None:
        """Count the calls the module itself plans (not a fall back to the Python paths)."""
        self.native_plans += isinstance(call(*batch, np.empty(BUFFER, dtype=np.int32), *options), SplitKVInfo)


def _host(rng, values, dtype):
    kind = rng.integers(4)
    if kind == 0:
        return np.array(values, dtype=dtype)
    if kind == 1:
        return torch.tensor(values, dtype=torch.int32 if dtype == np.int32 else torch.int64)
    if kind == 2:
        return np.array(values, dtype=dtype)[::-1].copy()[::-1]  # strided
    return np.array(values, dtype=dtype)


def prefill_case(rng):
    batch = int(rng.integers(1, 13))
    q = rng.integers(0, 301 if rng.random() < 0.4 else 41, batch)  # short ones too: fewer than 40 tiles
    q[rng.random(batch) < 0.2] = 0
    kv = np.where(rng.random(batch) < 0.5, rng.integers(0, 70001, batch), rng.integers(0, 400, batch))
    kv[rng.random(batch) < 0.1] = 0
    group, num_kv_heads = int(rng.choice([1, 4, 8])), int(rng.choice([1, 2, 8]))
    dtype = rng.choice([np.int32, np.int64])
    qo = np.concatenate([[0], np.cumsum(q)])
    options = dict(num_qo_heads=group * num_kv_heads, num_kv_heads=num_kv_heads,
                   tile_rows=[None, 16, 64, 128][rng.integers(4)], kv_granularity=int(rng.choice([1, 16, 64, 128])),
                   num_sms=int(rng.choice([1, 2, 7, 16, 66, 132, 264, int(rng.integers(1, 265))])),
                   item_overhead=int(rng.choice([0, 64, 128, int(rng.integers(0, 200))])),
                   enable_split=bool(rng.random() < 0.8), balance_tail=bool(rng.random() < 0.5),
                   split_min_waves=[None, 2.0][rng.integers(2)])
    if rng.random() < 0.25:  # a few SMs, balance_tail: the last wave's split (choose_tail_split)
        options.update(num_sms=int(rng.integers(1, 25)), enable_split=True, balance_tail=True, split_min_waves=2.0)
    if rng.random() < 0.4:
        options["max_batch_size"] = batch + int(rng.integers(0, 5))
        if rng.random() < 0.7:
            options["max_total_q"] = int(qo[-1]) + int(rng.integers(0, 70))
        if rng.random() < 0.5:
            options["capacity"] = int(rng.integers(0, 200))  # sometimes too few: the capacity PlanError
    kv_lens = _host(rng, kv.tolist(), dtype) if rng.random() < 0.8 else kv.tolist()
    return _host(rng, qo.tolist(), dtype), kv_lens, options


@pytest.fixture
def list_plans(monkeypatch):
    """Counts of the plans the Python list paths made (not None), by path, and of their last-wave splits."""
    counts = {"prefill": 0, "decode": 0, "tail": 0}

    def counting(kind, path):
        def plan(*args):
            result = path(*args)
            counts[kind] += result is not None
            return result
        return plan

    monkeypatch.setattr(split_kv, "plan_lists", counting("prefill", split_kv.plan_lists))
    monkeypatch.setattr(split_kv, "plan_decode_lists", counting("decode", split_kv.plan_decode_lists))
    monkeypatch.setattr(list_paths, "tail_split", counting("tail", list_paths.tail_split))
    return counts


def test_prefill_plans_equal_the_python_list_paths(module, list_plans):
    rng = np.random.default_rng(2024)
    twin = Twin(module)
    for _ in range(3000):
        qo, kv_lens, options = prefill_case(rng)
        twin.check(plan_split_kv, qo, kv_lens, **options)
        o = options
        twin.count(module.prefill, (qo, kv_lens), (
            o["num_qo_heads"], o["num_kv_heads"], o["tile_rows"], o["kv_granularity"], o["num_sms"],
            o["item_overhead"], o["enable_split"], o["balance_tail"], o["split_min_waves"], o.get("max_batch_size"),
            o.get("max_total_q"), o.get("capacity")))
    # the native planner plans where the list path does (the rest: capacity errors, bounds, the numpy path)
    assert twin.native_plans == list_plans["prefill"] > 1500
    assert list_plans["tail"] > 60, list_plans  # last-wave splits (balance_tail)


def decode_case(rng):
    batch = int(rng.integers(1, 25)) if rng.random() < 0.9 else int(rng.integers(0, 3))
    scale = int(rng.choice([64, 4096, 70000, 2**20]))
    kv = rng.integers(0, scale + 1, batch)
    kv[rng.random(batch) < 0.1] = 0
    group, num_kv_heads = int(rng.choice([1, 4, 8])), int(rng.choice([1, 2, 8]))
    options = dict(num_qo_heads=group * num_kv_heads, num_kv_heads=num_kv_heads,
                   tile_rows=[None, 16, 64][rng.integers(3)], kv_granularity=int(rng.choice([1, 16, 64, 128])),
                   num_sms=int(rng.choice([1, 16, 132, 264, 1024, int(rng.integers(1, 265))])),
                   item_overhead=int(rng.choice([0, 64, int(rng.integers(0, 200))])),
                   enable_split=bool(rng.random() < 0.85))
    if rng.random() < 0.4:
        options["max_batch_size"] = batch + int(rng.integers(0, 5))
        if rng.random() < 0.3:
            options["max_total_q"] = options["max_batch_size"] + int(rng.integers(0, 9))
        if rng.random() < 0.5:
            options["capacity"] = int(rng.integers(0, 400))
    dtype = rng.choice([np.int32, np.int64])
    return (_host(rng, kv.tolist(), dtype) if rng.random() < 0.8 else kv.tolist()), options


def test_decode_plans_equal_the_python_list_path(module, list_plans):
    rng = np.random.default_rng(7)
    twin = Twin(module)
    split_past_40 = 0
    for _ in range(3000):
        kv_lens, options = decode_case(rng)
        info = twin.check(plan_decode, kv_lens, **options)
        split_past_40 += info is not None and info.num_items > 40
        o = options
        twin.count(module.decode, (kv_lens,), (
            o["num_qo_heads"], o["num_kv_heads"], o["tile_rows"], o["kv_granularity"], o["num_sms"],
            o["item_overhead"], o["enable_split"], o.get("max_batch_size"), o.get("max_total_q"), o.get("capacity")))
    assert twin.native_plans == list_plans["decode"] > 2000
    assert split_past_40 > 200  # list_paths' n > 40 branch (fast_paths.split_decode_items)


@pytest.mark.parametrize("case", [
    ("prefill", (np.array([0, 128]), np.array([128])), dict(num_qo_heads=32, num_kv_heads=8, tile_rows=64)),
    ("prefill", (np.array([0, 0]), np.array([0])), dict(num_qo_heads=4, num_kv_heads=4)),
    ("prefill", (np.array([0]), np.array([], dtype=np.int64)), dict(num_qo_heads=4, num_kv_heads=4)),
    ("prefill", (np.array([0, 1000]), [2**30 - 1]), dict(num_qo_heads=8, num_kv_heads=1)),  # past a bound
    ("prefill", (np.array([0, 5, 3]), [9, 9]), dict(num_qo_heads=4, num_kv_heads=4)),  # falling qo_indptr
    ("prefill", (np.array([0, 5]), [-1]), dict(num_qo_heads=4, num_kv_heads=4)),
    ("prefill", (np.array([0, 5]), [9, 9]), dict(num_qo_heads=4, num_kv_heads=4)),  # kv_lens too long
    ("prefill", (np.array([0, 5.0]), [9]), dict(num_qo_heads=4, num_kv_heads=4)),
    ("prefill", (np.array([0, 5]), [9]), dict(num_qo_heads=4, num_kv_heads=3)),
    ("prefill", (np.array([0, 5]), [9]), dict(num_qo_heads=4, num_kv_heads=4, num_sms=0)),
    ("prefill", (np.array([0, 5]), [9]), dict(num_qo_heads=4, num_kv_heads=4, tile_rows=True)),
    ("prefill", (np.array([0, 5]), [9]), dict(num_qo_heads=4, num_kv_heads=4, max_batch_size=0)),
    ("prefill", (np.array([0, 5]), [9]), dict(num_qo_heads=4, num_kv_heads=4, max_batch_size=2, max_total_q=4)),
    ("prefill", (np.array([0, 5]), [9]), dict(num_qo_heads=4, num_kv_heads=4, max_batch_size=-1)),
    ("prefill", (np.array([0, 5]), [9]), dict(num_qo_heads=4, num_kv_heads=4, max_batch_size=2, capacity=-3)),
    ("prefill", (np.array([0, 5]), [9]), dict(num_qo_heads=4, num_kv_heads=4, max_batch_size=np.int64(2))),
    ("prefill", (np.array([0, 300]), [9000]), dict(num_qo_heads=4, num_kv_heads=4, capacity=2)),
    ("prefill", (np.array([0, 300]), [9000]), dict(num_qo_heads=4, num_kv_heads=4, split_min_waves=2)),
    ("prefill", (np.array([0, 300]), [9000]), dict(num_qo_heads=4, num_kv_heads=4, split_min_waves=np.float64(0.5))),
    ("prefill", (np.array([0, 300]), [9000]), dict(num_qo_heads=4, num_kv_heads=4, split_min_waves=float("nan"))),
    ("prefill", (np.array([0, 300]), [9000]), dict(num_qo_heads=4, num_kv_heads=4, split_min_waves=-float("inf"))),
    ("prefill", (torch.tensor([0, 9], dtype=torch.int16), torch.tensor([50], dtype=torch.uint8)),
     dict(num_qo_heads=2, num_kv_heads=1)),
    ("prefill", (np.array([0, 9], dtype=np.uint64), np.array([2**64 - 1], dtype=np.uint64)),
     dict(num_qo_heads=2, num_kv_heads=1)),
    ("prefill", (np.array([0, 9]), [True]), dict(num_qo_heads=2, num_kv_heads=1)),
    ("prefill", (np.array([0, 9]), [2**70]), dict(num_qo_heads=2, num_kv_heads=1)),
    ("prefill", (np.array([[0, 9]]), [5]), dict(num_qo_heads=2, num_kv_heads=1)),
    ("prefill", (np.array([0, 4096]), [4096]), dict(num_qo_heads=2**20, num_kv_heads=2**19, num_sms=3)),
    ("decode", ([],), dict(num_qo_heads=4, num_kv_heads=4)),
    ("decode", ([0, 0, 5],), dict(num_qo_heads=4, num_kv_heads=4, kv_granularity=16)),
    ("decode", ([10, 2**30],), dict(num_qo_heads=4, num_kv_heads=4)),
    ("decode", ([10, -2],), dict(num_qo_heads=4, num_kv_heads=4)),
    ("decode", ([10, 20],), dict(num_qo_heads=64, num_kv_heads=1, tile_rows=16)),  # a group past one tile
    ("decode", ([9000, 20],), dict(num_qo_heads=4, num_kv_heads=4, capacity=1)),
    ("decode", ([9000, 20],), dict(num_qo_heads=4, num_kv_heads=4, max_batch_size=1)),
    ("decode", ([9000, 20],), dict(num_qo_heads=4, num_kv_heads=4, max_batch_size=3, max_total_q=2)),
    ("decode", (np.array([9000, 20], dtype=">i4"),), dict(num_qo_heads=4, num_kv_heads=4)),
    ("decode", (torch.tensor([9000, 20]).cuda() if torch.cuda.is_available() else torch.tensor([9000.0]),),
     dict(num_qo_heads=4, num_kv_heads=4)),
], ids=lambda case: case[0])
def test_edges_and_errors_agree(module, case):
    kind, args, options = case
    Twin(module).check(plan_split_kv if kind == "prefill" else plan_decode, *args, **options)


def test_without_a_host_buffer_and_with_too_small_a_one(module):
    args = (np.array([0, 77, 300]), [500, 80000])
    options = dict(num_qo_heads=32, num_kv_heads=8, tile_rows=64, max_batch_size=4, max_total_q=400)
    python = plan_split_kv(*args, **options)
    with native.use(False):
        assert plan_split_kv(*args, **options).info == python.info
    plan = plan_split_kv(*args, **options)  # a buffer of its own, exactly numel long
    assert plan.host.numel() == plan.numel == python.numel and plan.info == python.info
    for name in plan.schema:
        assert plan.numpy(name).tolist() == python.numpy(name).tolist()
    small = torch.zeros(plan.numel - 1, dtype=torch.int32)
    for enabled in (True, False):
        with native.use(enabled), pytest.raises(PlanError, match=r"^host_buffer: needs an int32 CPU tensor of at "
                                                                  rf"least {plan.numel} elements"):
            plan_split_kv(*args, host_buffer=small, **options)
    assert not small.any()  # checked before writing
    with pytest.raises(PlanError, match="^host_buffer: needs a 1-D int32"):
        plan_decode([5], num_qo_heads=4, num_kv_heads=4, host_buffer=torch.zeros(64))


def test_a_custom_policy_keeps_the_python_path(module, monkeypatch):
    calls = []
    monkeypatch.setattr(native, "plan_prefill", lambda *args: calls.append(args))
    policy = heuristics.SplitPolicy(candidates=lambda *args: [2048])
    assert plan_split_kv([0, 512], [8192], num_qo_heads=8, num_kv_heads=8, split_policy=policy).info.kv_chunk == 2048
    assert calls == []
    plan_split_kv(np.array([0, 512]), [8192], num_qo_heads=8, num_kv_heads=8)
    assert len(calls) == 1


# ------------------------------------------------------------------------------------------------ the build


@pytest.fixture
def fresh(monkeypatch):
    """The process's native planner state, reset (restored after the test)."""
    for name, value in (("_module", None), ("_entry", None), ("_failure", None), ("_enabled", True),
                        ("_active", native._UNLOADED)):
        monkeypatch.setattr(native, name, value)


@pytest.fixture(scope="module")
def built(module) -> Path:
    """The session's planner entry."""
    return native.entry().path


def seed(cache: Path, built: Path) -> Path:
    """Copy the session's planner entry (``built``) into ``cache`` (no compile); returns the copy."""
    target = cache / build.ARCH / built.name
    shutil.copytree(built, target)
    return target


def test_the_key_follows_the_source_compiler_and_python():
    source = build.SOURCE.read_bytes()
    key = build.planner_key(source, "c++ 12")
    assert key == build.planner_key(source, "c++ 12") and len(key) == 64
    assert build.planner_key(source + b"\n", "c++ 12") != key
    assert build.planner_key(source, "c++ 13") != key
    assert build.content_key(source + b"\n") != build.content_key(source)


# a planner that plans nothing (None: the Python paths plan), quick to compile: for the tests of the build alone
STUB = b"""#define PY_SSIZE_T_CLEAN
#include <Python.h>
static PyObject* none(PyObject*, PyObject* const*, Py_ssize_t) { Py_RETURN_NONE; }
static PyMethodDef methods[] = {{"prefill", (PyCFunction)(void (*)())none, METH_FASTCALL, ""},
                                {"decode", (PyCFunction)(void (*)())none, METH_FASTCALL, ""}, {}};
static PyModuleDef stub = {PyModuleDef_HEAD_INIT, "flashgen_planner", "", -1, methods};
PyMODINIT_FUNC PyInit_flashgen_planner() { return PyModule_Create(&stub); }
"""


@pytest.fixture
def stub(tmp_path, monkeypatch) -> Path:
    """``build.SOURCE``: the stub planner."""
    path = tmp_path / "stub" / "planner.cpp"
    path.parent.mkdir()
    path.write_bytes(STUB)
    monkeypatch.setattr(build, "SOURCE", path)
    return path


def test_a_changed_source_builds_a_new_entry(built, cache_dir, tmp_path, monkeypatch):
    store = CacheStore(cache_dir)
    first = seed(cache_dir, built)
    assert build.ensure_built(store)[0].path == first  # found, not compiled
    changed = tmp_path / "planner.cpp"
    changed.write_bytes(STUB)
    monkeypatch.setattr(build, "SOURCE", changed)
    entry, module2 = build.ensure_built(store)
    assert entry.path != first and entry.path.parent == first.parent
    assert (entry.path / "planner.cpp").read_bytes() == STUB
    assert module2.decode(None) is None and store.verify() == []
    changed.write_bytes(STUB + b"// one byte more\n")
    assert build.ensure_built(store)[0].path not in (first, entry.path)


def _builder(cache: Path, results) -> None:
    """A process building the planner into ``cache``: puts (its compiles, the entry's path) on ``results``."""
    compiles = []
    compile_ = build._compile

    def counted(*args):
        compiles.append(1)
        return compile_(*args)

    build._compile = counted
    entry, _ = build.ensure_built(CacheStore(cache))
    results.put((len(compiles), str(entry.path)))


def test_concurrent_processes_build_it_once(stub, tmp_path):
    """Three forked processes (a fresh interpreter would spend seconds importing torch) at once, one cache."""
    fork = multiprocessing.get_context("fork")
    results = fork.SimpleQueue()
    procs = [fork.Process(target=_builder, args=(tmp_path / "cache", results)) for _ in range(3)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(300)
    assert [proc.exitcode for proc in procs] == [0, 0, 0]
    outs = [results.get() for _ in procs]
    assert sorted(compiles for compiles, _ in outs) == [0, 0, 1] and len({path for _, path in outs}) == 1
    store = CacheStore(tmp_path / "cache")
    assert len(store.entry_dirs()) == 1 and store.verify() == [] and store.build_dirs() == []


SECOND_PROCESS = """
import sys
from flashgen import jit_native as build
from flashgen.plan.request import SplitKVInfo
def refuse(*args):
    raise SystemExit("compiled")
build._compile = refuse
entry, module = build.ensure_built()
print(entry.path)
"""


def test_a_second_process_loads_it_without_compiling(built, cache_dir):
    first = seed(cache_dir, built)
    done = subprocess.run([sys.executable, "-c", SECOND_PROCESS], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO), "FLASHGEN_CACHE_DIR": str(cache_dir)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(first)


def test_an_aot_cache_needs_no_compiler(built, cache_dir, tmp_path, monkeypatch):
    aot = tmp_path / "aot"
    shipped = seed(aot, built)
    monkeypatch.setenv("FLASHGEN_EXTRA_CACHE_DIRS", str(aot))
    monkeypatch.setattr(build, "COMPILERS", (str(tmp_path / "missing" / "c++"),))
    entry, _ = build.ensure_built()
    assert entry.path == shipped and not (cache_dir / build.ARCH).exists()


def test_disable_jit_never_compiles(cache_dir, monkeypatch):
    monkeypatch.setenv("FLASHGEN_DISABLE_JIT", "1")
    with pytest.raises(build.NativeBuildError, match="FLASHGEN_DISABLE_JIT=1 and no cache holds a loadable planner"):
        build.ensure_built()
    assert not (cache_dir / build.ARCH).exists()


def test_a_failure_of_any_kind_falls_back(module, tmp_path, monkeypatch, fresh):
    monkeypatch.setattr(build, "SOURCE", tmp_path / "gone.cpp")  # a broken install
    with pytest.warns(RuntimeWarning, match="native planner is unavailable.*FileNotFoundError"):
        assert plan_decode([5, 9000], num_qo_heads=4, num_kv_heads=4).info.num_items > 2


def test_without_a_compiler_plans_warn_once_and_are_the_same(module, cache_dir, tmp_path, monkeypatch, fresh):
    args = (np.array([0, 128]), np.array([4000]))
    options = dict(num_qo_heads=32, num_kv_heads=8, tile_rows=64)
    monkeypatch.setattr(build, "COMPILERS", (str(tmp_path / "missing" / "c++"),))
    with native.use(False):  # (no load)
        expected = plan_split_kv(*args, **options)
    with pytest.warns(RuntimeWarning, match="native planner is unavailable.*no C\\+\\+ compiler: looked for .*missing"):
        plan = plan_split_kv(*args, **options)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once a process
        plan_decode([5, 9000], num_qo_heads=4, num_kv_heads=4)
    assert native.planner() is None and "no C++ compiler" in native.failure() and not native.available()
    assert plan.info == expected.info
    for name in plan.schema:
        assert plan.numpy(name).tolist() == expected.numpy(name).tolist()


def _corrupt(entry: Path, keep_digest: bool) -> None:
    so = entry / build.SHARED_OBJECT
    so.write_bytes(b"\x7fELF" + b"\0" * 64)
    if keep_digest:  # a shared object that matches its manifest but does not load
        import hashlib
        import json

        manifest = json.loads((entry / "manifest.json").read_text())
        manifest["cubin_size"], manifest["cubin_sha256"] = so.stat().st_size, hashlib.sha256(so.read_bytes()).hexdigest()
        (entry / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("keep_digest", [False, True], ids=["truncated", "unloadable"])
def test_a_corrupt_entry_is_passed_over_without_a_compiler(built, cache_dir, tmp_path, monkeypatch, fresh, keep_digest):
    entry = seed(cache_dir, built)
    _corrupt(entry, keep_digest)
    monkeypatch.setattr(build, "COMPILERS", (str(tmp_path / "missing" / "c++"),))
    with pytest.warns(RuntimeWarning, match="native planner is unavailable"):
        plan = plan_decode([5, 9000], num_qo_heads=4, num_kv_heads=4)
    assert plan.info.num_items > 2


def test_a_corrupt_entry_is_rebuilt(built, cache_dir):
    entry = seed(cache_dir, built)
    _corrupt(entry, keep_digest=True)
    store = CacheStore(cache_dir)
    rebuilt, loaded = build.ensure_built(store)
    assert rebuilt.path == entry and read_entry(entry)[0] is not None
    assert (entry / build.SHARED_OBJECT).stat().st_size > 1000 and callable(loaded.prefill)
