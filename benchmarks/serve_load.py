"""Server load: throughput and p50/p99 latency of `moetier serve` at 1, 8 and 32 concurrent clients, one replica or N
Ray replicas.

Starts `moetier serve MODEL` (default the bundled models/tiny-shakespeare-moe; `--server-args "..."` are passed
through, e.g. "--host-expert-mem 8MiB --max-batch 8") in a subprocess on a free loopback port (benchmarks/_serve.py),
waits for /health, then for each concurrency C in --concurrency runs C closed-loop clients (asyncio + httpx2: each
sends its next request when the previous one has ended) for --warmup seconds (not counted), then for --duration
seconds; requests in flight at the deadline finish and count. Requests: completions or chat (--chat-fraction),
streamed or not (--stream-fraction), `max_tokens` in --max-tokens LO[-HI], over a few Shakespeare prompts, greedy
unless --temperature. `--ray-replicas N` starts the server with `--ray local --replicas N` instead (N engine replicas
behind one HTTP front on a local Ray instance); `--with-single` runs the one-replica server first in the same run, as
the anchor. Clients and server share this machine's cores.

Reports per (setup, concurrency): requests completed, errors by kind (any non-200, transport error or malformed
response), completion tokens, wall time (to the last completion), requests/s, completion tokens/s, p50/p99 latency,
p50/p99 time to first token of the streams, and the server's mean decode batch (/metrics). Prints the machine (CPU,
cores, AVX-512/AMX detected now), a table, then one JSON line. Exits 1 if any request failed, 2 if the server did
not start.

    python benchmarks/serve_load.py [--concurrency 1,8,32] [--duration 30] [--warmup 5] [--max-tokens 32]
        [--stream-fraction 0.5] [--server-args "--max-batch 8"] [--ray-replicas 2 [--with-single]] [--model PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import sys
from collections import Counter
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `benchmarks._serve` from any cwd

from benchmarks._serve import (
    API_KEY_ENV,
    BUNDLED_MODEL,
    Mix,
    Server,
    closed_loop,
    error_kinds,
    exit_on_server_failure,
    fmt,
    machine,
    machine_line,
    make_client,
    missing_flags,
    percentile,
    running_server,
    scrape,
    sigterm_as_interrupt,
    token_range,
    total,
)

RAY_FLAGS = ["--ray", "--replicas"]


def _decode_rows(m: dict[str, float]) -> tuple[float, float]:
    """(decode steps, sequence-steps) so far, from the runner's step count and mean batch."""
    steps = total(m, "moetier_batch_decode_steps_total")
    return steps, steps * total(m, "moetier_batch_mean_size")


async def measure(server: Server, setup: str, clients: int, args: argparse.Namespace, mix: Mix) -> dict[str, Any]:
    """One (setup, concurrency) row: warm-up, then the measured closed loop."""
    async with make_client(clients, mix, args.api_key) as client:
        # 1. warm-up (not counted), 2. the measured window between two /metrics scrapes
        await closed_loop(client, server.base, server.model_name, clients, args.warmup, mix, args.seed + 7,
                          alive=server.alive)  # fmt: skip
        before = await scrape(client, server.base)
        load = await closed_loop(client, server.base, server.model_name, clients, args.duration, mix, args.seed,
                                 alive=server.alive)  # fmt: skip
        after = await scrape(client, server.base)
    # 3. the row
    ok = [o for o in load.outcomes if o.status == "ok"]
    lat = [o.latency for o in ok]
    ttft = [o.ttft for o in ok if o.stream and o.ttft is not None]
    wall = load.ended - load.started
    tokens = sum(o.tokens for o in ok)
    (s0, r0), (s1, r1) = _decode_rows(before), _decode_rows(after)
    kinds = error_kinds(load.outcomes)
    replicas = Counter(o.replica for o in ok if o.replica is not None)
    return {
        "setup": setup, "concurrency": clients, "requests": len(ok), "errors": sum(kinds.values()),
        "error_kinds": kinds, "streamed": sum(o.stream for o in ok), "completion_tokens": tokens, "wall_s": wall,
        "requests_per_s": len(ok) / wall, "tokens_per_s": tokens / wall,
        "p50_s": percentile(lat, 50), "p99_s": percentile(lat, 99),
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "mean_decode_batch": (r1 - r0) / (s1 - s0) if before and after and s1 > s0 else None,
        "requests_per_replica": dict(sorted(replicas.items())),
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(BUNDLED_MODEL), help="checkpoint folder (default: the bundled model)")
    ap.add_argument("--server-args", default="", help='extra `moetier serve` flags, one string: "--max-batch 8"')
    ap.add_argument("--concurrency", default="1,8,32", help="concurrent clients, comma-separated")
    ap.add_argument("--duration", type=float, default=30.0, help="measured seconds per concurrency")
    ap.add_argument("--warmup", type=float, default=5.0, help="seconds of the same load before each measurement")
    ap.add_argument("--stream-fraction", type=float, default=0.5)
    ap.add_argument("--chat-fraction", type=float, default=0.5)
    ap.add_argument("--max-tokens", type=token_range, default=(32, 32), help="N or LO-HI (uniform)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--ray-replicas", type=int, default=0, metavar="N",
                    help="serve with `--ray local --replicas N` instead of one in-process engine")  # fmt: skip
    ap.add_argument("--with-single", action="store_true", help="with --ray-replicas: run one replica first too")
    ap.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                    help=f"sent as a Bearer token (when the server checks one); default: ${API_KEY_ENV}")  # fmt: skip
    ap.add_argument("--timeout", type=float, default=600.0, help="per-request client timeout, seconds")
    ap.add_argument("--start-timeout", type=float, default=300.0, help="seconds to wait for /health")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    extra = shlex.split(args.server_args)

    # 1. the setups; the Ray one needs `moetier serve --ray/--replicas`
    setups: list[tuple[str, list[str]]] = []
    if not args.ray_replicas or args.with_single:
        setups.append(("single", extra))
    if args.ray_replicas:
        missing = missing_flags(RAY_FLAGS)
        if missing:
            print(f"error: --ray-replicas needs `moetier serve {' '.join(RAY_FLAGS)}`, which this moetier does not "
                  f"have (missing: {', '.join(missing)}); run without --ray-replicas", file=sys.stderr)  # fmt: skip
            sys.exit(2)
        setups.append((f"ray x{args.ray_replicas}", ["--ray", "local", "--replicas", str(args.ray_replicas), *extra]))
    mix = Mix(args.stream_fraction, args.chat_fraction, 0.0, args.max_tokens, args.temperature, args.timeout)
    mach = machine()

    # 2. every setup: its own server, every concurrency level against it
    sigterm_as_interrupt()
    rows: list[dict[str, Any]] = []
    with exit_on_server_failure():
        for setup, server_args in setups:
            with running_server(args.model, server_args, args.start_timeout, api_key=args.api_key) as server:
                for c in levels:
                    if not server.alive():
                        break  # (its stderr tail is printed when the block ends; the rows so far are reported)
                    rows.append(asyncio.run(measure(server, setup, c, args, mix)))
                    r = rows[-1]
                    print(f"  {setup} c={c}: {r['requests']} requests, {r['errors']} errors, "
                          f"{r['tokens_per_s']:.1f} tok/s", file=sys.stderr, flush=True)  # fmt: skip

    # 3. report: machine, table, one JSON line
    lo, hi = args.max_tokens
    print(f"serve load: {args.model}; server args: {' '.join(extra) or '-'}; {args.duration:g} s per level after "
          f"{args.warmup:g} s warm-up; max_tokens {lo if lo == hi else f'{lo}-{hi}'}, temperature "
          f"{args.temperature:g}, {args.stream_fraction:.0%} streamed, {args.chat_fraction:.0%} chat")  # fmt: skip
    print(machine_line(mach))
    print(f"{'setup':<10}{'clients':>8}{'requests':>9}{'errors':>7}{'req/s':>8}{'tok/s':>9}{'p50 s':>8}{'p99 s':>8}"
          f"{'ttft50':>8}{'ttft99':>8}{'batch':>7}")  # fmt: skip
    for r in rows:
        print(f"{r['setup']:<10}{r['concurrency']:>8}{r['requests']:>9}{r['errors']:>7}{r['requests_per_s']:>8.2f}"
              f"{r['tokens_per_s']:>9.1f}{fmt(r['p50_s']):>8}{fmt(r['p99_s']):>8}{fmt(r['ttft_p50_s']):>8}"
              f"{fmt(r['ttft_p99_s']):>8}{fmt(r['mean_decode_batch'], '.2f'):>7}")  # fmt: skip
        if r["error_kinds"]:
            print(f"{'':<10}errors: {', '.join(f'{k} x{n}' for k, n in r['error_kinds'].items())}")
        if len(r["requests_per_replica"]) > 1:
            print(f"{'':<10}requests per replica: {', '.join(map(str, r['requests_per_replica'].values()))}")
    print(json.dumps({
        "benchmark": "serve_load", "machine": mach, "model": args.model, "server_args": extra,
        "ray_replicas": args.ray_replicas, "duration_s": args.duration, "warmup_s": args.warmup,
        "stream_fraction": args.stream_fraction, "chat_fraction": args.chat_fraction, "max_tokens": [lo, hi],
        "temperature": args.temperature, "rows": rows,
    }))  # fmt: skip
    if any(r["errors"] for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
