"""Cold expert reads from disk: the old path (buffered pread, one expert at a time) against formats/diskio.py
(O_DIRECT, a layer call's misses in flight together), as GB/s and as a fraction of the sequential cold read
bandwidth `moetier profile` measures (runtime/profile_disk.py: O_DIRECT, 4 MiB reads, one in flight).

The workload is what a layer call with every expert missing asks of the store: per pass, every expert of the
benchmark checkpoint (benchmarks/_models.py, a ~600 MB Qwen3-MoE bf16 safetensors file) is read once into a
pool slot, in layer calls of top-k (8) distinct experts drawn in a seeded random order. Before every pass the page
cache is dropped (`sync; echo 3 > /proc/sys/vm/drop_caches`, which needs root; without it the buffered
variants are not cold and the row says so). Variants run interleaved, round after round; the table gives the
median of the rounds. Variants:
  old             ExpertReader without DiskIO: buffered os.preadv, one expert after another (store._load_host)
  buffered-dN     DiskIO(direct=False, depth=N): buffered, the call's experts in flight together
  direct-dN       DiskIO(direct=True, depth=N): O_DIRECT, the call's experts in flight together
  direct-dN-c4M   the same with requests cut at 4 MiB, capped at one expert's bytes (default: 1 MiB)
  direct-bounce   direct-d4 into destinations 64 bytes off alignment: every byte through the bounce buffers
  profile-cold    runtime/profile_disk.disk_bandwidth's cold figure (its own temp file in --tmp-dir)

    python benchmarks/disk_reads.py [--rounds 5] [--depths 1,2,4,8] [--profile-mb 512]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `benchmarks._models` from any cwd

import torch

from moetier.formats.diskio import DiskIO
from moetier.formats.safetensors import ExpertReader
from moetier.models.open import open_checkpoint
from moetier.runtime.profile_disk import disk_bandwidth
from moetier.store.source import FullSource
from moetier.types import ExpertKey


def drop_caches() -> bool:
    """Drop the page cache (root only); whether it was dropped."""
    subprocess.run(["sync"], check=False)
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


@dataclass(frozen=True)
class _ProfileOpts:
    disk_mb: int
    tmp_dir: Path | None
    rounds: int = 1


def calls_of(keys: list[ExpertKey], k: int, seed: int) -> list[list[ExpertKey]]:
    """Every key once, as layer calls of k distinct experts of one layer, layers and calls in a seeded order."""
    rng = random.Random(seed)
    calls = []
    for layer in sorted({key.layer for key in keys}):
        mine = [key for key in keys if key.layer == layer]
        rng.shuffle(mine)
        calls += [mine[i : i + k] for i in range(0, len(mine), k)]
    rng.shuffle(calls)
    return calls


def one_pass(src: FullSource, views: list[Any], calls: list[list[ExpertKey]], batched: bool) -> tuple[float, int]:
    """(seconds, bytes) of reading every call's experts into the slots `views`."""
    n = 0
    t0 = time.perf_counter()
    for call in calls:
        if batched:
            got = src.read_many(list(zip(call, views, strict=False)))
            for g in got:
                if isinstance(g, BaseException):
                    raise g
                n += g
        else:
            for key, v in zip(call, views, strict=False):
                n += src.read_into(key, v)
    return time.perf_counter() - t0, n


class _Shifted:
    """Slot views whose pieces sit 64 bytes past an aligned address (forces the bounce path)."""

    def __init__(self, like: Any) -> None:
        self.pieces = {}
        for name, t in like.pieces.items():
            raw = torch.empty(t.numel() * t.element_size() + 4096 + 64, dtype=torch.uint8)
            at = (-raw.data_ptr()) % 4096 + 64
            self.pieces[name] = raw[at : at + t.numel() * t.element_size()].view(t.dtype).view(t.shape)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--depths", default="1,2,4,8")
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--profile-mb", type=int, default=512)
    ap.add_argument("--cache-dir", default=".bench")
    ap.add_argument("--tmp-dir", default=".bench", help="folder of profile-cold's temp file (same disk as the model)")
    args = ap.parse_args()
    from benchmarks._models import qwen3_bench_model
    from benchmarks.vs_llamacpp import cpu_isa

    path = qwen3_bench_model(args.cache_dir)
    o = open_checkpoint(path, "bf16", torch.device("cpu"))
    keys = list(o.reader.plans)
    depths = [int(d) for d in args.depths.split(",")]
    plan: list[tuple[str, DiskIO | None, bool]] = [("old", None, False)]
    plan += [(f"direct-d{d}", DiskIO(direct=True, depth=d), False) for d in depths]
    plan += [("direct-d4-c4M", DiskIO(direct=True, depth=4, chunk=4 << 20), False),
             ("direct-d8-c4M", DiskIO(direct=True, depth=8, chunk=4 << 20), False)]
    plan += [("buffered-d4", DiskIO(direct=False, depth=4), False), ("direct-bounce", DiskIO(direct=True), True)]
    prefixes = {s.layer: s.ckpt_prefix for s in o.sites}
    variants: list[tuple[str, FullSource, bool, bool]] = []  # (name, source, batched, shifted destinations)
    for name, io, shift in plan:
        reader = ExpertReader(o.index, o.family.sources, o.reader.layout, prefixes, o.num_experts, o.dtype)
        if io is not None:
            reader.set_io(io)
        variants.append((name, FullSource(reader, o.dtype), io is not None, shift))
    src = variants[0][1]
    pool = src.make_pool(args.top_k, torch.device("cpu"))
    aligned = list(pool.views)
    shifted = [_Shifted(v) for v in aligned]
    seen: dict[str, list[float]] = {v[0]: [] for v in variants}
    seen["profile-cold"] = []
    dropped = True
    for rnd in range(args.rounds):
        calls = calls_of(keys, args.top_k, seed=rnd)
        for name, vsrc, batched, shift in variants:
            dropped &= drop_caches()
            secs, n = one_pass(vsrc, shifted if shift else aligned, calls, batched)
            seen[name].append(n / secs)
            print(f"round {rnd} {name:14s} {n / secs / 1e9:6.2f} GB/s", file=sys.stderr, flush=True)
        dropped &= drop_caches()
        prof = disk_bandwidth(_ProfileOpts(args.profile_mb, Path(args.tmp_dir)))
        seen["profile-cold"].append(prof["cold_bw"])
        print(f"round {rnd} profile-cold   {prof['cold_bw'] / 1e9:6.2f} GB/s ({prof['cold_method']})", file=sys.stderr)
    isa = cpu_isa()
    seq = statistics.median(seen["profile-cold"])
    rows = []
    print(f"\ncpu: {isa['cpu']}; ISA: {' '.join(isa['flags'])}; model: {path} ({len(keys)} experts, "
          f"{src.slot_bytes / 2**20:.2f} MiB each); rounds: {args.rounds}; caches dropped: {dropped}")  # fmt: skip
    print(f"{'variant':14s} {'GB/s (median)':>14s} {'min':>6s} {'max':>6s} {'of profile cold':>16s}")
    for name, vals in seen.items():
        med = statistics.median(vals)
        print(f"{name:14s} {med / 1e9:14.2f} {min(vals) / 1e9:6.2f} {max(vals) / 1e9:6.2f} {med / seq:16.0%}")
        rows.append({"variant": name, "median_gbs": med / 1e9, "all_gbs": [v / 1e9 for v in vals],
                     "fraction_of_profile_cold": med / seq, "cpu": isa["cpu"], "isa": isa["flags"]})  # fmt: skip
    print(json.dumps({"benchmark": "disk_reads", "model": str(path), "experts": len(keys),
                      "expert_bytes": src.slot_bytes, "top_k": args.top_k, "rounds": args.rounds,
                      "caches_dropped": dropped, "profile_cold_gbs": seq / 1e9, "rows": rows}))  # fmt: skip
    for _, vsrc, _, _ in variants:
        vsrc.close()


if __name__ == "__main__":
    main()
