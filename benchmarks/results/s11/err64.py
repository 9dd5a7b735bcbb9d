# max / mean abs error of the portable prefill against an fp64 reference (ragged, bf16, 32 q / 8 kv heads, d128)
import sys, torch, numpy as np
sys.path.insert(0, ".")
import flashgen
from flashgen import AttentionSpec, Causal, NoMask, Ragged
HQ, HKV, D = 32, 8, 128
torch.manual_seed(0)
for b, n in ((2, 2048),):
    q = torch.randn(b * n, HQ, D, dtype=torch.bfloat16, device="cuda")
    k, v = (torch.randn(b * n, HKV, D, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    v = v + 0.5  # a V with a nonzero mean, where the two row-sum forms differ most
    ind = np.arange(b + 1, dtype=np.int32) * n
    for name, mask in (("none", NoMask()), ("causal", Causal())):
        w = flashgen.BatchPrefillWrapper(AttentionSpec(D, kv_layout=Ragged(), mask=mask), backend="portable")
        w.plan(qo_indptr=ind, kv_indptr=ind, num_qo_heads=HQ, num_kv_heads=HKV)
        out = w.run(q, (k, v)).double()
        qs, ks, vs = (t.double().view(b, n, -1, D).transpose(1, 2) for t in (q, k, v))
        ks, vs = ks.repeat_interleave(HQ // HKV, 1), vs.repeat_interleave(HQ // HKV, 1)
        s = qs @ ks.transpose(-1, -2) / D ** 0.5
        if name == "causal":
            s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device="cuda").triu(1), float("-inf"))
        ref = (torch.softmax(s, -1) @ vs).transpose(1, 2).reshape(b * n, HQ, D)
        err = (out - ref).abs()
        print(f"{sys.argv[1] if len(sys.argv) > 1 else ''} {name} {b}x{n}: max abs err {float(err.max()):.5f} mean {float(err.mean()):.6f}")
