"""T5's prefill on the H200 with the heavy-hook loops of 19110cd (sm90/softmax.cuh hooks_rolled, prefill/math.cuh
hook_logits_rolled) unrolled by different factors, one fresh cache each; it edits the headers (and, for the
Hopper configurations with ``o`` / ``q``, drops the O staging / the second Q buffer in kernels/prefill_sm90.py)
in place and restores them. Meaningful at 19110cd only.

    PYTHONPATH=$PWD:$PWD/benchmarks python3 benchmarks/experiments/exp_heavy_rolled.py 16,1,2,4,1o,1oq,4oq 1/1,1/2,4/8

First list: Hopper unroll factors of the 16 8-key blocks (16: fully unrolled, the code before 19110cd; o: no O
staging; q: one Q buffer). Second: portable ``slots/nt`` factors (4/8: fully unrolled).
"""
import os
import subprocess
import sys
from pathlib import Path
inc = Path("templates/include/flashgen")
sm90 = inc / "sm90/softmax.cuh"
port = inc / "prefill/math.cuh"
main = inc / "sm90/mainloop.cuh"
M0 = main.read_text()
fam_py = Path("flashgen/kernels/prefill_sm90.py")
F0 = fam_py.read_text()
O_DEF = "def sm90_o_staged(head_dim: int, gather: bool, elem: int = 2, kv8: int = 0) -> bool:\n"
Q_DEF = "def sm90_q_buffers(head_dim: int, elem: int = 2) -> int:\n"
assert O_DEF in F0 and Q_DEF in F0
S0 = sm90.read_text(); P0 = port.read_text()
SM_OLD = "#pragma unroll 1\n  for (int b = 0; b < BLOCKS; ++b) {\n    const float4 in = buf[b];"
P_OUT = "#pragma unroll 1\n  for (int slot = 0; slot < C::MMA_Q * 2; ++slot) {"
P_IN = "#pragma unroll 1\n    for (int nt = 0; nt < NT; ++nt) {\n      const float2 in"
assert SM_OLD in S0 and P_OUT in P0 and P_IN in P0
out = os.environ["OUT"]
configs = [("sm90", u, None) for u in sys.argv[1].split(",")] + [("portable", o, i) for o, i in (c.split("/") for c in sys.argv[2].split(","))]
for fam, a, b in configs:
    sm90.write_text(S0); port.write_text(P0); main.write_text(M0); fam_py.write_text(F0)
    if fam == "sm90":
        normal = a.endswith("n")
        f = F0
        if "o" in a:
            f = f.replace(O_DEF, O_DEF + "    return False\n")
        if "q" in a:
            f = f.replace(Q_DEF, Q_DEF + "    return 1\n")
        fam_py.write_text(f)
        orig = a
        a = a.rstrip("noq")
        sm90.write_text(S0.replace(SM_OLD, SM_OLD.replace("unroll 1", f"unroll {a}")))
        if normal:
            main.write_text(M0.replace("if constexpr (C::Variant::HEAVY) {", "if constexpr (false) {"))
            pass
        a = orig
    else:
        port.write_text(P0.replace(P_OUT, P_OUT.replace("unroll 1", f"unroll {a}")).replace(P_IN, P_IN.replace("unroll 1", f"unroll {b}")))
    tag = f"{fam}-u{a}" + (f"-{b}" if b else "")
    env = dict(os.environ, FLASHGEN_CACHE_DIR=f"/tmp/fg-{tag}")
    r = subprocess.run([sys.executable, "benchmarks/bench_variants.py", "--examples", "t5_bias", "--shapes", "4x4096,1x16384",
                        "--reps", "10", "--backends", fam, "--no-flex", "--out", f"{out}/unroll-{tag}.json"], env=env, capture_output=True, text=True)
    lines = [l for l in r.stdout.splitlines() if "TFLOP/s" in l and "|" not in l]
    print(tag, *lines, r.stderr[-500:] if r.returncode else "", sep="\n  ", flush=True)
sm90.write_text(S0); port.write_text(P0); main.write_text(M0); fam_py.write_text(F0)
