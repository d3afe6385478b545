"""Soak test: 10 minutes of mixed requests with random disconnects at a host expert budget of 25% of the expert bytes;
no error, no memory growth.

Computes the model's routed expert bytes as `moetier info` does (moetier.models.open.describe), starts
`moetier serve MODEL --host-expert-mem <--budget-fraction of them>` (default the bundled models/tiny-shakespeare-moe;
`--server-args "..."` are passed through) in a subprocess on a free loopback port (benchmarks/_serve.py), then runs
--clients closed-loop clients (asyncio + httpx2) for --warmup seconds and then --duration seconds. Requests:
completions or chat (--chat-fraction), streamed or not (--stream-fraction), `max_tokens` uniform in --max-tokens,
sampled at --temperature with a per-request seed. A fraction --disconnect-fraction of the requests is closed early
on purpose: a stream after a random number of events (mid-stream), a non-streaming request after a random delay
(0.02-0.5 s; one that answered sooner counts as served). Every other outcome than a complete, well-formed 200
response or such a disconnect is an error (a non-200 status, 429 included, a transport error, a stream without
`[DONE]` or with an error event).

Every --interval seconds: requests served, disconnects, errors (by kind), p50/p99 latency of the requests that ended
in the interval, the server's RSS (VmRSS of its pid) and the expert hit rate per tier over the interval (deltas of
moetier_expert_hits_total / moetier_expert_misses_total from /metrics). At the end, after the requests in flight
have finished: RSS at start (after warm-up), middle and end, growth after warm-up in %, totals, the server's own 5xx
and cancelled counts, and whether the server went back to idle (no slot or queue entry left by a disconnect).
Prints the machine (CPU, cores, AVX-512/AMX detected now), a table per interval, then one JSON line.

Exit status: 0 when there was no error (warm-up included), RSS at the end is at most --rss-limit % above RSS after
warm-up (`rss_growth_ok`), the server went idle after the load (`idle_after_ok`) and did not die (`server_died`, which
also ends the run early); 1 otherwise; 2 when the server did not start. Ctrl-C or SIGTERM stops the server.

    python benchmarks/soak.py [--duration 600] [--interval 30] [--clients 8] [--disconnect-fraction 0.1]
        [--budget-fraction 0.25] [--warmup 30] [--server-args "--max-batch 8"] [--model PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `benchmarks._serve` from any cwd

import httpx2

from benchmarks._serve import (
    API_KEY_ENV,
    BUNDLED_MODEL,
    Load,
    Mix,
    Outcome,
    Server,
    by_label,
    closed_loop,
    error_kinds,
    exit_on_server_failure,
    expert_bytes,
    fmt,
    hit_rates,
    machine,
    machine_line,
    make_client,
    percentile,
    rss_bytes,
    running_server,
    scrape,
    sigterm_as_interrupt,
    token_range,
    total,
)

IDLE_WAIT_S = 30.0  # after the load, how long the server may take to free every slot


@dataclass(frozen=True)
class Sample:
    """What the monitor reads at an interval's end."""

    t: float  # seconds since the measured phase started
    rss: int | None
    metrics: dict[str, float]


def interval_row(k: int, outcomes: list[Outcome], prev: Sample, now: Sample) -> dict[str, Any]:
    """One interval's figures: the outcomes that ended in it, RSS at its end, hit rate between its two scrapes."""
    ok = [o for o in outcomes if o.status == "ok"]
    lat = [o.latency for o in ok]
    kinds = error_kinds(outcomes)
    return {
        "interval": k, "t_end_s": now.t, "served": len(ok),
        "disconnects": sum(o.status == "disconnect" for o in outcomes), "errors": sum(kinds.values()),
        "error_kinds": kinds, "completion_tokens": sum(o.tokens for o in ok),
        "p50_s": percentile(lat, 50), "p99_s": percentile(lat, 99), "rss_bytes": now.rss,
        "hit_rate": hit_rates(prev.metrics, now.metrics) if prev.metrics and now.metrics else {},
    }  # fmt: skip


async def wait_idle(client: httpx2.AsyncClient, base: str, seconds: float) -> dict[str, Any]:
    """Poll /health until nothing runs or waits; its last body (with "idle")."""
    deadline = time.monotonic() + seconds
    body: dict[str, Any] = {}
    while time.monotonic() < deadline:
        try:
            body = (await client.get(f"{base}/health", timeout=10)).json()
        except (httpx2.HTTPError, ValueError):
            body = {}
        if body.get("running") == 0 and body.get("queued") == 0:
            return body | {"idle": True}
        await asyncio.sleep(0.5)
    return body | {"idle": False}


async def soak(server: Server, args: argparse.Namespace, mix: Mix) -> dict[str, Any]:
    """Warm-up, the measured phase with a sample every interval, the drain; the figures (see the module doc)."""
    async with make_client(args.clients, mix, args.api_key) as client:
        # 1. warm-up; its errors count too
        warm = await closed_loop(client, server.base, server.model_name, args.clients, args.warmup, mix, args.seed + 7,
                                 alive=server.alive)  # fmt: skip
        first = Sample(0.0, rss_bytes(server.pid), await scrape(client, server.base))
        # 2. the measured phase, sampled at each interval's end while the clients run
        n = max(1, math.ceil(args.duration / args.interval))
        load = Load()
        task = asyncio.ensure_future(
            closed_loop(client, server.base, server.model_name, args.clients, args.duration, mix, args.seed, load,
                        server.alive)
        )  # fmt: skip
        t0 = time.monotonic()
        samples = [first]
        for k in range(1, n + 1):
            t_k = min(k * args.interval, args.duration)
            while server.alive() and time.monotonic() < t0 + t_k:
                await asyncio.sleep(min(1.0, max(0.0, t0 + t_k - time.monotonic())))
            if not server.alive():  # died: no more intervals (the verdict fails on the missing end RSS)
                break
            samples.append(Sample(time.monotonic() - t0, rss_bytes(server.pid), await scrape(client, server.base)))
            if args.progress:
                done = [o for o in load.outcomes if o.end - t0 > samples[-2].t]
                rss = fmt((samples[-1].rss or 0) / 2**20, ".1f")
                print(f"  t={samples[-1].t:6.0f} s: {sum(o.status == 'ok' for o in done)} served, "
                      f"{sum(o.status == 'error' for o in done)} errors, RSS {rss} MiB",
                      file=sys.stderr, flush=True)  # fmt: skip
        await task  # 3. the drain: requests in flight at the deadline finish (they count in the last interval)
        idle = await wait_idle(client, server.base, IDLE_WAIT_S) if server.alive() else {"idle": False}
        final = Sample(time.monotonic() - t0, rss_bytes(server.pid), await scrape(client, server.base))
    # 4. per interval: outcomes by end time
    n = max(1, len(samples) - 1)
    buckets: list[list[Outcome]] = [[] for _ in range(n)]
    for o in load.outcomes:
        buckets[min(n - 1, max(0, int((o.end - t0) // args.interval)))].append(o)
    rows = [interval_row(k, buckets[k - 1], samples[k - 1], samples[k]) for k in range(1, len(samples))]
    return {"warm": warm, "load": load, "samples": samples, "final": final, "rows": rows, "idle": idle,
            "server_died": not server.alive()}  # fmt: skip


def summarise(res: dict[str, Any], args: argparse.Namespace, expert: int, budget: int) -> dict[str, Any]:
    """Totals, RSS start / middle / end and growth, the pass/fail flags."""
    load: Load = res["load"]
    warm: Load = res["warm"]
    samples: list[Sample] = res["samples"]
    first, final = samples[0], res["final"]
    middle = samples[min(len(samples) - 1, max(1, round((len(samples) - 1) / 2)))]
    outs = load.outcomes
    ok = [o for o in outs if o.status == "ok"]
    lat = [o.latency for o in ok]
    kinds = error_kinds(warm.outcomes + outs)
    rss0, rss_end = first.rss, final.rss
    growth = 100.0 * (rss_end - rss0) / rss0 if rss0 and rss_end else None
    peak = max((s.rss for s in [*samples, final] if s.rss), default=None)
    status0 = by_label(first.metrics, "moetier_requests_total", "status")
    status1 = by_label(final.metrics, "moetier_requests_total", "status")
    server_5xx = sum(v - status0.get(s, 0.0) for s, v in status1.items() if s.startswith("5"))
    cancelled = by_label(final.metrics, "moetier_requests_finished_total", "reason").get("cancelled", 0.0) - by_label(
        first.metrics, "moetier_requests_finished_total", "reason"
    ).get("cancelled", 0.0)  # fmt: skip
    errors = sum(kinds.values())
    rss_ok = growth is not None and growth <= args.rss_limit
    out = {
        "benchmark": "soak", "model": args.model, "duration_s": args.duration, "interval_s": args.interval,
        "warmup_s": args.warmup, "clients": args.clients, "stream_fraction": args.stream_fraction,
        "chat_fraction": args.chat_fraction, "disconnect_fraction": args.disconnect_fraction,
        "max_tokens": list(args.max_tokens), "temperature": args.temperature, "expert_bytes": expert,
        "budget_fraction": args.budget_fraction, "budget_bytes": budget,
        "served": len(ok), "disconnects": sum(o.status == "disconnect" for o in outs), "errors": errors,
        "warmup_requests": len(warm.outcomes), "warmup_errors": sum(o.status == "error" for o in warm.outcomes),
        "error_kinds": kinds, "completion_tokens": sum(o.tokens for o in ok),
        "requests_per_s": len(ok) / (load.ended - load.started), "p50_s": percentile(lat, 50),
        "p99_s": percentile(lat, 99), "hit_rate": hit_rates(first.metrics, final.metrics),
        "server_5xx": server_5xx if final.metrics else None, "server_cancelled": cancelled if final.metrics else None,
        "server_completion_tokens": total(final.metrics, "moetier_completion_tokens_total") or None,
        "rss_start_bytes": rss0, "rss_middle_bytes": middle.rss, "rss_end_bytes": rss_end, "rss_peak_bytes": peak,
        "rss_growth_pct": growth, "rss_limit_pct": args.rss_limit, "rss_growth_ok": rss_ok,
        "idle_after_ok": bool(res["idle"].get("idle")), "server_died": res["server_died"], "intervals": res["rows"],
    }  # fmt: skip
    out["ok"] = errors == 0 and rss_ok and out["idle_after_ok"] and not out["server_died"]
    return out


def report(out: dict[str, Any], mach: dict[str, Any], extra: list[str]) -> None:
    mib = 2**20
    lo, hi = out["max_tokens"]
    print(f"soak: {out['model']}; host expert budget {out['budget_bytes'] / mib:.1f} MiB "
          f"({out['budget_fraction']:.0%} of {out['expert_bytes'] / mib:.1f} MiB of experts); server args: "
          f"{' '.join(extra) or '-'}; {out['clients']} clients, {out['duration_s']:g} s after {out['warmup_s']:g} s "
          f"warm-up; {out['stream_fraction']:.0%} streamed, {out['chat_fraction']:.0%} chat, "
          f"{out['disconnect_fraction']:.0%} disconnected on purpose; max_tokens {lo}-{hi}, "
          f"temperature {out['temperature']:g}")  # fmt: skip
    print(machine_line(mach))
    print(f"{'t s':>7}{'served':>8}{'discon':>8}{'errors':>8}{'p50 s':>8}{'p99 s':>8}{'RSS MiB':>9}  hit rate")
    for r in out["intervals"]:
        rate = " ".join(f"{t} {fmt(v)}" for t, v in r["hit_rate"].items()) or "-"
        rss = fmt(r["rss_bytes"] / mib if r["rss_bytes"] else None, ".1f")
        print(f"{r['t_end_s']:>7.0f}{r['served']:>8}{r['disconnects']:>8}{r['errors']:>8}{fmt(r['p50_s']):>8}"
              f"{fmt(r['p99_s']):>8}{rss:>9}  {rate}")  # fmt: skip
    rate = " ".join(f"{t} {fmt(v)}" for t, v in out["hit_rate"].items()) or "-"
    print(f"{'total':>7}{out['served']:>8}{out['disconnects']:>8}{out['errors']:>8}{fmt(out['p50_s']):>8}"
          f"{fmt(out['p99_s']):>8}{'':>9}  {rate}")  # fmt: skip

    def size(v: int | None) -> str:
        return fmt(v / mib if v else None, ".1f")

    growth = fmt(out["rss_growth_pct"], "+.2f")
    print(f"server RSS: start {size(out['rss_start_bytes'])} MiB (after warm-up), "
          f"middle {size(out['rss_middle_bytes'])}, end {size(out['rss_end_bytes'])}, "
          f"peak {size(out['rss_peak_bytes'])}; growth {growth}% "
          f"(limit {out['rss_limit_pct']:g}%: {'ok' if out['rss_growth_ok'] else 'FAIL'})")  # fmt: skip
    kinds = ", ".join(f"{k} x{n}" for k, n in out["error_kinds"].items()) or "none"
    print(f"errors: {out['errors']} ({kinds}; {out['warmup_errors']} in warm-up); server 5xx: "
          f"{fmt(out['server_5xx'], 'g')}, cancelled by the server: {fmt(out['server_cancelled'], 'g')}; "
          f"idle after the load: {'yes' if out['idle_after_ok'] else 'NO'}; "
          f"{'THE SERVER DIED; ' if out['server_died'] else ''}{out['requests_per_s']:.2f} requests/s; "
          f"{'PASS' if out['ok'] else 'FAIL'}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(BUNDLED_MODEL), help="checkpoint folder (default: the bundled model)")
    ap.add_argument("--server-args", default="", help='extra `moetier serve` flags, one string: "--max-batch 8"')
    ap.add_argument("--duration", type=float, default=600.0, help="measured seconds (after the warm-up)")
    ap.add_argument("--interval", type=float, default=30.0, help="seconds per reported interval")
    ap.add_argument("--warmup", type=float, default=30.0, help="seconds of load before RSS 'start' is read")
    ap.add_argument("--clients", type=int, default=8, help="concurrent closed-loop clients")
    ap.add_argument("--stream-fraction", type=float, default=0.5)
    ap.add_argument("--chat-fraction", type=float, default=0.5)
    ap.add_argument("--disconnect-fraction", type=float, default=0.1, help="requests closed early on purpose")
    ap.add_argument("--max-tokens", type=token_range, default=(8, 64), help="N or LO-HI (uniform)")
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--budget-fraction", type=float, default=0.25, help="host expert budget / expert bytes")
    ap.add_argument("--rss-limit", type=float, default=5.0, help="allowed RSS growth after warm-up, percent")
    ap.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                    help=f"sent as a Bearer token (when the server checks one); default: ${API_KEY_ENV}")  # fmt: skip
    ap.add_argument("--timeout", type=float, default=600.0, help="per-request client timeout, seconds")
    ap.add_argument("--start-timeout", type=float, default=300.0, help="seconds to wait for /health")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                    help="a line on stderr per interval")  # fmt: skip
    args = ap.parse_args()
    if args.interval <= 0 or args.duration <= 0 or args.clients < 1 or not 0 < args.budget_fraction <= 1:
        ap.error("--interval and --duration must be > 0, --clients >= 1, 0 < --budget-fraction <= 1")

    # 1. the budget from the checkpoint's expert bytes; the machine
    expert = expert_bytes(args.model)
    budget = int(expert * args.budget_fraction)
    extra = shlex.split(args.server_args)
    mix = Mix(args.stream_fraction, args.chat_fraction, args.disconnect_fraction, args.max_tokens, args.temperature,
              args.timeout)  # fmt: skip
    mach = machine()

    # 2. the server, the soak; the server is stopped on every way out
    sigterm_as_interrupt()
    server_args = ["--host-expert-mem", str(budget), *extra]
    with exit_on_server_failure(), running_server(args.model, server_args, args.start_timeout,
                                                  api_key=args.api_key) as server:  # fmt: skip
        res = asyncio.run(soak(server, args, mix))

    # 3. report: table, then one JSON line
    out = summarise(res, args, expert, budget)
    report(out, mach, extra)
    print(json.dumps(out | {"machine": mach, "server_args": server_args}))
    if not out["ok"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
