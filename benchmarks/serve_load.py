"""Server load: 32 concurrent clients against `moetier serve`, vs the same requests one at a time.

Starts `moetier serve` on the bundled model (models/tiny-shakespeare-moe) in a subprocess on a
free loopback port (so clients and server do not share a GIL), then sends the same request set
twice with the official `openai` async client:
  1. sequential: every request alone, one after another;
  2. concurrent: `--clients` clients at once, each sending its `--requests` requests in turn.
Requests alternate completions (non-streaming) and chat (streaming), greedy, `--max-tokens` each,
over a few Shakespeare prompts. Every request must complete with no error. Reports per mode: requests,
errors, completion tokens, wall time, total tokens/s, p50 / p99 request latency; the server's
mean decode batch from /metrics. Prints a table, then one JSON line.

    python benchmarks/serve_load.py [--clients 32] [--requests 4] [--max-tokens 32] [--max-batch 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "models" / "tiny-shakespeare-moe"
NAME = "tiny-shakespeare-moe"
PROMPTS = ["ROMEO:", "JULIET:\nO Romeo", "First Citizen:\nBefore we proceed", "KING HENRY:", "Good morrow,",
           "HAMLET:\nTo be", "What light", "MERCUTIO:\nNay", "Now is the winter", "Friends, Romans"]  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(port: int, max_batch: int, max_queue: int, dtype: str) -> subprocess.Popen[str]:
    import httpx2

    cmd = [sys.executable, "-m", "moetier.cli", "serve", str(MODEL), "--port", str(port), "--max-batch",
           str(max_batch), "--max-queue", str(max_queue), "--dtype", dtype, "--log-level", "warning"]  # fmt: skip
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.communicate()[1]}")
        try:
            if httpx2.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx2.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("server did not come up in 120 s")


async def one(client: Any, i: int, max_tokens: int) -> tuple[float, int]:
    """Request i -> (latency s, completion tokens); chat requests stream."""
    t0 = time.perf_counter()
    prompt = PROMPTS[i % len(PROMPTS)]
    if i % 2 == 0:
        out = await client.completions.create(model=NAME, prompt=prompt, max_tokens=max_tokens, temperature=0)
        return time.perf_counter() - t0, int(out.usage.completion_tokens)
    stream = await client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0,
        stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    tokens = 0
    async for chunk in stream:
        if chunk.usage is not None:
            tokens = int(chunk.usage.completion_tokens)
    return time.perf_counter() - t0, tokens


async def run_mode(base: str, ids: list[list[int]], max_tokens: int, concurrent: bool) -> dict[str, Any]:
    """ids[c] = request indices of client c; concurrent: all clients at once, else every request alone."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=600)
    lat: list[float] = []
    tokens = 0
    errors: list[str] = []

    async def client_loop(reqs: list[int]) -> None:
        nonlocal tokens
        for i in reqs:
            try:
                dt, n = await one(client, i, max_tokens)
                lat.append(dt)
                tokens += n
            except Exception as exc:
                errors.append(f"{type(exc).__name__}: {exc}")

    t0 = time.perf_counter()
    if concurrent:
        await asyncio.gather(*(client_loop(r) for r in ids))
    else:
        for r in ids:
            await client_loop(r)
    wall = time.perf_counter() - t0
    await client.close()
    lat.sort()
    return {
        "requests": len(lat) + len(errors), "completed": len(lat), "errors": len(errors), "error_samples": errors[:3],
        "completion_tokens": tokens, "wall_s": wall, "tok_s": tokens / wall,
        "p50_s": statistics.median(lat) if lat else None,
        "p99_s": lat[min(len(lat) - 1, round(0.99 * (len(lat) - 1)))] if lat else None,
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--requests", type=int, default=4, help="requests per client")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--max-queue", type=int, default=64)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    ids = [[c * args.requests + k for k in range(args.requests)] for c in range(args.clients)]
    port = _free_port()
    proc = start_server(port, args.max_batch, args.max_queue, args.dtype)
    base = f"http://127.0.0.1:{port}"
    try:
        asyncio.run(run_mode(base, [[0, 1]], args.max_tokens, concurrent=False))  # warm-up
        seq = asyncio.run(run_mode(base, ids, args.max_tokens, concurrent=False))
        before = _metrics(base)
        conc = asyncio.run(run_mode(base, ids, args.max_tokens, concurrent=True))
        after = _metrics(base)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    steps = after["moetier_batch_decode_steps_total"] - before["moetier_batch_decode_steps_total"]
    rows_before = before["moetier_batch_mean_size"] * before["moetier_batch_decode_steps_total"]
    rows_after = after["moetier_batch_mean_size"] * after["moetier_batch_decode_steps_total"]
    conc["mean_decode_batch"] = (rows_after - rows_before) / steps if steps else 0.0
    print(f"serve load: {args.clients} clients x {args.requests} requests, max_tokens {args.max_tokens}, "
          f"--max-batch {args.max_batch}, dtype {args.dtype}, {os.cpu_count()} CPUs")  # fmt: skip
    print(f"{'mode':<12}{'requests':>9}{'errors':>8}{'tokens':>8}{'wall s':>9}{'tok/s':>9}{'p50 s':>9}{'p99 s':>9}")
    for mode, r in (("sequential", seq), ("concurrent", conc)):
        print(f"{mode:<12}{r['requests']:>9}{r['errors']:>8}{r['completion_tokens']:>8}{r['wall_s']:>9.2f}"
              f"{r['tok_s']:>9.1f}{r['p50_s']:>9.3f}{r['p99_s']:>9.3f}")  # fmt: skip
    print(f"throughput ratio concurrent/sequential: {conc['tok_s'] / seq['tok_s']:.2f}x; "
          f"mean decode batch (concurrent): {conc['mean_decode_batch']:.2f}")  # fmt: skip
    print(json.dumps({"benchmark": "serve_load", "clients": args.clients, "requests_per_client": args.requests,
                      "max_tokens": args.max_tokens, "max_batch": args.max_batch, "dtype": args.dtype,
                      "sequential": seq, "concurrent": conc, "ratio": conc["tok_s"] / seq["tok_s"]}))  # fmt: skip
    if seq["errors"] or conc["errors"]:
        sys.exit(1)


def _metrics(base: str) -> dict[str, float]:
    import httpx2

    out = {}
    for line in httpx2.get(f"{base}/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


if __name__ == "__main__":
    main()
