"""The wide step's cost in attention: one attention half (`moetier_attn_half`, csrc/step.c) of the benchmark model's
shape at a given cache depth, on the bf16 step and on the wide step (`RuntimeConfig.residual="fp32"`: fp32 q against
an fp16 KV cache, nothing rounded to bf16), in one process on the same weights, interleaved rounds, medians.

Why a kernel-level A/B: end-to-end rows of `benchmarks/vs_llamacpp.py` on this project's VM move with its two memory
bandwidth modes by more than the difference measured here, and a candidate's rounds tend to share a mode; here the
two variants read the same weights, alternate within each round, and differ only in the attention math.

    python benchmarks/wide_attention.py [--depths 0,512,2048] [--rounds 7] [--calls 200] [--threads 2]

Prints the CPU and, per depth, microseconds per call of each variant and their ratio, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.vs_llamacpp import cpu_isa
from moetier.kernels import decode, native
from moetier.kernels.step import AttnLayer, AttnSpec, Step

H, NH, NKV, HD, E, K = 1024, 16, 4, 64, 64, 8  # benchmarks/_models.py's Qwen3-MoE shape
CAP = 4096


def layer(g: torch.Generator) -> AttnLayer:
    """Random bf16 weights of one attention half (q/k norms per head, a softmax top-8 router)."""

    def rnd(*shape: int, s: float = 0.05) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * s).to(torch.bfloat16)

    n = (NH + 2 * NKV) * HD
    inv = 1.0 / (1e6 ** (torch.arange(0, HD, 2, dtype=torch.float64) / HD))
    ang = torch.arange(CAP, dtype=torch.float64)[:, None] * inv[None]
    ang = torch.cat([ang, ang], -1)
    spec = AttnSpec(H, NH, NKV, HD, 1e-6, 0.0, 1, E, K, True, True)
    return AttnLayer(spec, 0, 1 + rnd(H), 1 + rnd(H), rnd(n, H), None, rnd(H, NH * HD), None, 1 + rnd(HD),
                     1 + rnd(HD), ang.cos().to(torch.bfloat16), ang.sin().to(torch.bfloat16), rnd(E, H, s=0.5),
                     None, 0, None)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depths", default="0,512,2048")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    lib = decode.load(True, None)
    if lib is None:
        raise SystemExit(f"no native kernels here: {native.load_error(True, None)}")
    torch.set_num_threads(a.threads)
    isa = cpu_isa()
    print(f"CPU: {isa['cpu']}; {' '.join(isa['flags'])}; kernels {lib.moetier_isa_name().decode()}", file=sys.stderr)
    g = torch.Generator().manual_seed(0)
    att = layer(g)
    rows = []
    for depth in (int(d) for d in a.depths.split(",")):
        runs: dict[bool, list[float]] = {False: [], True: []}
        steps = {}
        for wide in (False, True):
            st = Step(lib, 1, H, 1, K, E, [att], [], None, CAP, a.threads, wide=wide)
            dtype = torch.float16 if wide else torch.bfloat16
            kc = (torch.randn(1, NKV, CAP, HD, generator=g) * 0.5).to(dtype)
            vc = (torch.randn(1, NKV, CAP, HD, generator=g) * 0.5).to(dtype)
            st.layer(0)
            st.s.nthreads, st.s.T = a.threads, 1
            st.pos[0], st.cap[0], st.kc[0], st.vc[0] = depth, CAP, kc.data_ptr(), vc.data_ptr()
            steps[wide] = (st, kc, vc)
        x = torch.randn(1, H, generator=g)
        for _ in range(a.rounds):
            for wide in (False, True):
                st = steps[wide][0]
                t0 = time.perf_counter()
                for _ in range(a.calls):
                    st.stream[:1].copy_(x)
                    st.attn(att)
                runs[wide].append((time.perf_counter() - t0) / a.calls * 1e6)
        bf16, wide_us = statistics.median(runs[False]), statistics.median(runs[True])
        rows.append({"depth": depth, "bf16_us": round(bf16, 1), "wide_us": round(wide_us, 1),
                     "ratio": round(wide_us / bf16, 3), "bf16_runs": [round(v, 1) for v in runs[False]],
                     "wide_runs": [round(v, 1) for v in runs[True]]})  # fmt: skip
        print(f"depth {depth:>5}: bf16 step {bf16:8.1f} us, wide {wide_us:8.1f} us a call ({wide_us / bf16:.2f}x)")
    print(json.dumps({"benchmark": "wide_attention", "isa": isa, "threads": a.threads, "rows": rows}))


if __name__ == "__main__":
    main()
