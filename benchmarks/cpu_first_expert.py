"""Does this CPU show HybriMoE's Fig. 3(e) effect: the first expert of a layer call slower, the next ones faster?

HybriMoE III: "the first expert computation on the CPU is slower, but subsequent tasks are processed faster with
better cache utilization". The simulator's cost model has a parameter for it (profile `cpu.first_expert_s`);
`moetier profile` measures it at decode load on its reference shape. This benchmark runs the same measurement
(runtime/profile_first_expert.py) with the engine's own expert kernel (kernels/experts.py SwiGLU over bf16
weights) on a published model's expert shape and at several token loads.

Method (the module's): a layer call computes n experts one after the other (distinct weights, the same tokens
each, as decode does); before each call a buffer larger than the last-level cache is read, standing in for the
attention and dense work between MoE layers. Each expert's wall time is taken separately; over --rounds calls
the median time of the expert at each position is reported. first_expert_s = median(position 0) -
median(positions 1..n-1); "profile rule" says whether `moetier profile` would record it (beyond the later
positions' spread) or write 0. Rounds of the token counts are interleaved.

    python -m benchmarks.cpu_first_expert [--spec qwen2-57b-a14b] [--experts 8] [--tokens 1,16] [--rounds 40]

Prints the CPU (ISA flags, AMX present or not), a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
from types import SimpleNamespace

import torch

from benchmarks.vs_llamacpp import cpu_isa
from moetier.runtime.profile_first_expert import first_expert_estimate, position_times
from moetier.specs import load_spec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default="qwen2-57b-a14b", help="model spec whose expert shape is used")
    ap.add_argument("--experts", type=int, default=8, help="experts per layer call")
    ap.add_argument("--tokens", default="1,16", help="tokens per expert, comma-separated")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--flush-mib", type=int, default=256, help="buffer read between layer calls")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    # 1. the experts: distinct bf16 weights in the engine's canonical layout (w13 [2I, H], w2 [H, I])
    spec = load_spec(args.spec)
    h, i = spec.hidden, spec.moe_inter
    experts = [
        SimpleNamespace(w13=torch.randn(2 * i, h, dtype=torch.bfloat16) * 0.02,  # [2I, H]
                        w2=torch.randn(h, i, dtype=torch.bfloat16) * 0.02)  # [H, I]
        for _ in range(args.experts)
    ]  # fmt: skip
    counts = [int(t) for t in args.tokens.split(",")]

    # 2. interleaved rounds (two warm-up rounds), each expert timed: the package's measurement
    times = position_times(experts, h, counts, args.rounds, args.flush_mib << 20, warmup=2)

    # 3. report
    isa = cpu_isa()
    amx = [f for f in isa["flags"] if f.startswith("amx")]
    print(f"cpu: {isa['cpu']}; ISA flags: {' '.join(isa['flags']) or '-'}; AMX: {'yes' if amx else 'no'}; "
          f"torch {torch.__version__}, {args.threads} threads; spec {args.spec} (H={h}, I={i}), "
          f"{args.experts} experts per call, {args.rounds} rounds")  # fmt: skip
    out: dict[str, object] = {"cpu": isa, "amx": bool(amx), "spec": args.spec, "hidden": h, "moe_intermediate": i,
                              "experts": args.experts, "rounds": args.rounds, "threads": args.threads}  # fmt: skip
    for t in counts:
        est = first_expert_estimate(times[t])
        med, later, first = list(est.medians_s), est.later_s, est.diff_s
        print(
            f"tokens {t:>3}: per position (ms) "
            + " ".join(f"{m * 1e3:.3f}" for m in med)
            + f"  -> first_expert_s = {first * 1e3:+.3f} ms ({med[0] / later:.2f}x a later expert); "
            f"profile rule: {est.reason}"
        )
        out[f"tokens_{t}"] = {
            "median_s_by_position": med,
            "later_s": later,
            "first_expert_s": first,
            "noise_s": est.noise_s,
            "profile_first_expert_s": est.first_expert_s,
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
