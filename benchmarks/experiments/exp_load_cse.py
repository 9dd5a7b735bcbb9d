"""Whether the compiler merges repeated loads of one address, by the way a declared tensor is read: the
``ld.global.nc`` asm of ``common/variant.cuh`` ``load_input``, ``__ldg`` and a plain load. A kernel compares one
loaded value with a constant N times. No GPU needed: the size of each kernel's ``.text`` (sm_90a, nvcc -O3), 16
bytes an instruction, and its global loads in SASS (``cuobjdump -sass``, LDG). A kernel as long as with N = 1 had
its loads merged and the comparisons folded (cicc); one LDG with a longer kernel had the loads merged by ptxas
alone, the arithmetic on them kept N times.

    python3 benchmarks/experiments/exp_load_cse.py
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

from flashgen.compile import find_nvcc

SOURCE = """#include <cstdint>
__device__ __forceinline__ int load(const int* ptr) { %s }
extern "C" __global__ void k(const int* p, int* o, int i, int j) {
  int s = 0;
#pragma unroll
  for (int u = 0; u < N; ++u) s += load(p + i) == j ? 1 : 0;
  o[threadIdx.x] = s;
}
"""
LOADS = {
    "asm ld.global.nc (load_input)": 'uint32_t v; asm("ld.global.nc.b32 %0, [%1];" : "=r"(v) : "l"(ptr)); return int(v);',
    "__ldg": "return __ldg(ptr);",
    "plain load": "return *ptr;",
}


def text_instructions(cubin: Path) -> int:
    out = subprocess.run(["readelf", "-SW", str(cubin)], capture_output=True, text=True).stdout
    for line in out.splitlines():
        if ".text.k" in line and ".rel" not in line:
            return int(line.split("]")[1].split()[4], 16) // 16
    raise RuntimeError(f"no .text.k in {cubin}")


def sass_loads(cubin: Path) -> str:
    tool = shutil.which("cuobjdump")
    if tool is None:
        return "-"
    sass = subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    return str(sum(1 for line in sass.splitlines() if "LDG" in line))


def main() -> None:
    nvcc = str(find_nvcc().path)
    with tempfile.TemporaryDirectory() as tmp:
        print(f"{'load':32} {'N=1':>5} {'N=8':>5}  instructions   LDG at N=8")
        for name, body in LOADS.items():
            sizes = []
            for n in (1, 8):
                src, cubin = Path(tmp) / "k.cu", Path(tmp) / f"k{n}.cubin"
                src.write_text(SOURCE % body)
                subprocess.run([nvcc, "-cubin", "-arch=sm_90a", "-O3", f"-DN={n}", "-o", str(cubin), str(src)],
                               check=True)
                sizes.append(text_instructions(cubin))
            print(f"{name:32} {sizes[0]:5} {sizes[1]:5}  {sass_loads(cubin):>24}")


if __name__ == "__main__":
    main()
