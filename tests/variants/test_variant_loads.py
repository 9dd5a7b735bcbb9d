"""How the kernels read a variant's declared tensors: by ld.global.nc (PTX), and a value that depends on the row
alone once a row a tile, not once a (query, key) pair (SASS, where cuobjdump is found).

The ALiBi example (``slopes[qo_head] * (kv_idx - qo_idx)``) is compared with the same arithmetic over a constant
slope: whatever the two kernels' code differs by is the reading of ``slopes``.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from flashgen import jit
from flashgen.compile import find_nvcc
from flashgen.compile.ninja_build import ptx_flags
from flashgen.kernels import include_dir
from flashgen.spec import AttentionSpec, Causal, NoMask, Paged, Ragged, Variant
from flashgen.variants.examples import EXAMPLES

ALIBI = EXAMPLES["alibi"][0]
CONSTANT = Variant(score=lambda score, q_idx, kv_idx: score + 0.25 * (kv_idx - q_idx))
FAMILIES = [("decode", Paged(16)), ("prefill", Ragged()), ("prefill_sm90", Ragged())]
PLAIN_LOAD = re.compile(r"^\s*(?:@%p\d+\s+)?ld\.global\.(?!nc)", re.M)
NC_LOAD = re.compile(r"^\s*(?:@%p\d+\s+)?ld\.global\.nc\.", re.M)


def _spec(variant, op, layout):
    return AttentionSpec(128, kv_layout=layout, mask=NoMask() if op == "decode" else Causal(), variant=variant)


def _nvcc(folder: Path, source: str, *flags: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "kernel.cu").write_text(source)
    cmd = [str(find_nvcc().path), *flags, f"-I{include_dir()}", "kernel.cu"]
    done = subprocess.run(cmd, cwd=folder, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def _ptx(folder: Path, spec, op) -> str:
    _nvcc(folder, jit.render(spec, op), *[f for f in ptx_flags("sm_90a") if not f.startswith("--threads")],
          "-o", "kernel.ptx")
    return (folder / "kernel.ptx").read_text()


@pytest.mark.nvcc
def test_every_declared_dtype_is_read_by_ld_global_nc(tmp_path):
    source = """#include <flashgen/common/variant.cuh>
using flashgen::variant::Tensor;
struct P { Tensor<bool, 1> a; Tensor<uint8_t, 1> b; Tensor<int32_t, 2> c; Tensor<int64_t, 1> d; Tensor<__half, 1> e;
           Tensor<__nv_bfloat16, 1> f; Tensor<float, 3> g; float* out; };
extern "C" __global__ void read_all(const __grid_constant__ P p) {
  const int i = threadIdx.x;
  p.out[i] = float(p.a[i]) + float(p.b[i]) + float(p.c(i, 2)) + float(p.d[i]) + __half2float(p.e[i]) +
             __bfloat162float(p.f[i]) + p.g(i, 1, 2);
}
"""
    _nvcc(tmp_path, source, "-ptx", "-arch=sm_90a", "-O3", "-std=c++17", "-o", "kernel.ptx")
    ptx = (tmp_path / "kernel.ptx").read_text()
    widths = re.findall(r"ld\.global\.nc\.(\w+)", ptx)
    assert sorted(widths) == sorted(["u8", "u8", "b32", "b64", "b16", "b16", "b32"]), widths
    assert not PLAIN_LOAD.search(ptx)


@pytest.mark.nvcc
@pytest.mark.parametrize("op, layout", FAMILIES, ids=[op for op, _ in FAMILIES])
def test_a_hook_reads_its_tensors_by_ld_global_nc(tmp_path, op, layout):
    """The tensor read adds ld.global.nc loads and not one plain load."""
    alibi = _ptx(tmp_path / "alibi", _spec(ALIBI, op, layout), op)
    constant = _ptx(tmp_path / "constant", _spec(CONSTANT, op, layout), op)
    assert len(PLAIN_LOAD.findall(alibi)) == len(PLAIN_LOAD.findall(constant))
    assert len(NC_LOAD.findall(alibi)) > len(NC_LOAD.findall(constant))


def _cuobjdump() -> str | None:
    here = Path(sys.prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    for path in (shutil.which("cuobjdump"), find_nvcc().path.parent / "cuobjdump",
                 here / "triton" / "backends" / "nvidia" / "bin" / "cuobjdump"):
        if path and Path(path).is_file():
            return str(path)
    return None


# (op, the thread's (query, key) pairs of one tile that a read a pair would show as loads): decode 2 n-tiles x 4
# registers; the portable prefill MMA_Q (2) x TILE_KV / 8 (8) x 4. The Hopper prefill is left out: the item's last
# tile (the one reaching past kv_hi) keeps a branch a pair, whose loads stay in its code (run once an item).
PER_PAIR = [("decode", Paged(16), 8), ("prefill", Ragged(), 64)]


@pytest.mark.nvcc
@pytest.mark.parametrize("op, layout, pairs", PER_PAIR, ids=[op for op, _, _ in PER_PAIR])
def test_a_per_row_value_is_read_once_a_row_not_once_a_pair(tmp_path, op, layout, pairs):
    tool = _cuobjdump()
    if tool is None:
        pytest.skip("cuobjdump not found")
    counts = []
    for name, variant in (("alibi", ALIBI), ("constant", CONSTANT)):
        folder = tmp_path / name
        _ptx(folder, _spec(variant, op, layout), op)
        done = subprocess.run([str(find_nvcc().path), "-cubin", "-arch=sm_90a", "-o", "kernel.cubin", "kernel.ptx"],
                              cwd=folder, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        sass = subprocess.run([tool, "-sass", "kernel.cubin"], cwd=folder, capture_output=True, text=True,
                              check=True).stdout
        counts.append(len(re.findall(r"\bLDG\.E[.\w]*\.CONSTANT\b", sass)))
    # the thread's rows (2 a row group), at each of the kernel's call sites: far below a load a pair
    assert counts[0] - counts[1] < pairs // 2, counts
