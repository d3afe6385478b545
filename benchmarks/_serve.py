"""Shared by the server benchmarks (serve_load.py, soak.py): a `moetier serve` subprocess, its metrics and RSS, and
closed-loop HTTP clients.

- `running_server(model, args)` starts `python -m moetier.cli serve MODEL --port P ARGS...` on a free loopback port in
  its own session (so a terminal Ctrl-C reaches only the benchmark, which then stops the server itself), waits for
  `GET /health` = 200 and reads the served model id from `/v1/models`. Its stderr goes to a temporary file (a pipe
  could fill up and stall a long run); a server that exits or never gets healthy raises `ServerStartError` with the
  command and the stderr tail (one that dies later prints its tail when the block ends). On leaving the block,
  whatever happened (an error, Ctrl-C, SIGTERM: see `sigterm_as_interrupt`), the server gets SIGINT (uvicorn's
  graceful stop), then after `stop_timeout_s` its whole process group gets SIGKILL.
- `closed_loop(...)`: N clients, each sending its next request as soon as the previous one ended, until a deadline;
  every request becomes one `Outcome` (ok, a deliberate disconnect, or an error with its kind). The request mix
  (`Mix`): completions or chat, streamed or not, random `max_tokens`, and a fraction closed early on purpose
  (streams after a random number of events, non-streaming requests after a random delay).
- `scrape(client, base)`: `GET /metrics` parsed into {"name{labels}": value}; `total(m, name)` sums a metric over
  its labels, `by_label(m, name, label)` splits it.
- `rss_bytes(pid)`: VmRSS of one process from /proc; `machine()`: the CPU model, core count and ISA (AVX-512, AMX)
  detected at run time by benchmarks.vs_llamacpp.cpu_isa.

Invariants: an outcome is "error" for anything but a complete, well-formed response or a disconnect the client chose
(a non-200 status, a transport error, a stream without `[DONE]` or with an error event, a body without usage); the
server is stopped on every exit path of `running_server`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import httpx2

ROOT = Path(__file__).resolve().parent.parent
BUNDLED_MODEL = ROOT / "models" / "tiny-shakespeare-moe"
PROMPTS = ("ROMEO:", "JULIET:\nO Romeo", "First Citizen:\nBefore we proceed", "KING HENRY:", "Good morrow,",
           "HAMLET:\nTo be", "What light", "MERCUTIO:\nNay", "Now is the winter", "Friends, Romans")  # fmt: skip
STDERR_TAIL_LINES = 40
REPLICA_HEADER = "x-moetier-replica"  # set by the Ray Serve deployment (moetier.serve.ray_deploy)
API_KEY_ENV = "MOETIER_API_KEY"  # the server reads it too, so the clients default to it


# ---------------------------------------------------------------- 1. the server process


class ServerStartError(RuntimeError):
    """`moetier serve` exited or never answered /health; the message carries the command and its stderr tail."""


@dataclass
class Server:
    """A running `moetier serve` subprocess."""

    proc: subprocess.Popen[bytes]
    base: str  # http://127.0.0.1:PORT
    model_name: str
    stderr_path: Path
    cmd: list[str]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stderr_tail(self, lines: int = STDERR_TAIL_LINES) -> str:
        return tail(self.stderr_path, lines)


def tail(path: Path, lines: int = STDERR_TAIL_LINES) -> str:
    """The last `lines` lines of a text file ("" when unreadable)."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve_help() -> str:
    """`moetier serve --help`, wide and without colour (to check which flags this version has)."""
    env = os.environ | {"COLUMNS": "400", "NO_COLOR": "1", "TERM": "dumb"}
    out = subprocess.run([sys.executable, "-m", "moetier.cli", "serve", "--help"], capture_output=True, text=True,
                         env=env, check=False)  # fmt: skip
    return out.stdout + out.stderr


def missing_flags(flags: list[str]) -> list[str]:
    """Those of `flags` that `moetier serve --help` does not list."""
    text = serve_help()
    return [f for f in flags if re.search(re.escape(f) + r"(?![\w-])", text) is None]


def sigterm_as_interrupt() -> None:
    """SIGTERM raises KeyboardInterrupt, so `finally` blocks (the server's stop) run as on Ctrl-C; SIGINT gets
    Python's own handler back even where the shell started us with it ignored (a background job)."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, signal.default_int_handler)


@contextlib.contextmanager
def exit_on_server_failure() -> Iterator[None]:
    """The scripts' way out: a server that did not start is `error: ...` and exit 2, Ctrl-C / SIGTERM exit 130
    (the server is already stopped by running_server's own `finally`)."""
    try:
        yield
    except ServerStartError as exc:
        print(f"error: the server did not start: {exc}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted; the server was stopped", file=sys.stderr)
        sys.exit(130)


def _stop(proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    """SIGINT (graceful), then SIGKILL of the whole process group (the server and anything it started)."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout_s)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)  # start_new_session: the group id is the server's pid
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(10)


def _wait_healthy(proc: subprocess.Popen[bytes], base: str, timeout_s: float, headers: dict[str, str]) -> str:
    """Poll /health until 200, then return the served model id; ServerStartError if the process exits first or
    the deadline passes (the caller adds the stderr tail)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise ServerStartError(f"the server exited with status {proc.returncode} before /health answered 200")
        if time.monotonic() > deadline:
            raise ServerStartError(f"/health did not answer 200 within {timeout_s:g} s")
        try:
            if httpx2.get(f"{base}/health", timeout=2).status_code == 200:
                models = httpx2.get(f"{base}/v1/models", headers=headers, timeout=10)
                models.raise_for_status()
                return str(models.json()["data"][0]["id"])
        except httpx2.TransportError:
            pass
        time.sleep(0.25)


@contextlib.contextmanager
def running_server(
    model: str | os.PathLike[str],
    args: list[str],
    start_timeout_s: float = 300.0,
    stop_timeout_s: float = 30.0,
    api_key: str | None = None,
) -> Iterator[Server]:
    """`moetier serve MODEL ARGS` on a free loopback port, healthy; always stopped on exit (see the module doc)."""
    # 1. start: own session, stderr to a file, --log-level warning unless the caller chose one
    port = free_port()
    log = ["--log-level", "warning"] if "--log-level" not in args else []
    cmd = [sys.executable, "-m", "moetier.cli", "serve", str(model), "--host", "127.0.0.1", "--port", str(port),
           *log, *args]  # fmt: skip
    fd, name = tempfile.mkstemp(prefix="moetier-serve-", suffix=".stderr")
    stderr_path = Path(name)
    env = os.environ | {"HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1")}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=fd, env=env, start_new_session=True)
    os.close(fd)
    base = f"http://127.0.0.1:{port}"
    started = False
    try:
        # 2. healthy, or a ServerStartError that shows why
        try:
            model_name = _wait_healthy(proc, base, start_timeout_s, auth_headers(api_key))
        except (ServerStartError, httpx2.HTTPError, KeyError, IndexError, ValueError) as exc:
            _stop(proc, stop_timeout_s)
            raise ServerStartError(f"{exc}\n  command: {' '.join(cmd)}\n  stderr (last lines):\n"
                                   f"{tail(stderr_path)}") from None  # fmt: skip
        started = True
        yield Server(proc, base, model_name, stderr_path, cmd)
    finally:
        # 3. always stopped; a server that died during the run shows why
        died = proc.poll()
        _stop(proc, stop_timeout_s)
        if started and died is not None:
            print(f"note: the server exited with status {died} during the run; stderr (last lines):\n"
                  f"{tail(stderr_path)}", file=sys.stderr)  # fmt: skip
        with contextlib.suppress(OSError):
            stderr_path.unlink()


def rss_bytes(pid: int) -> int | None:
    """Resident set size of process `pid` (VmRSS in /proc/PID/status); None when it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def expert_bytes(model: str | os.PathLike[str]) -> int:
    """Routed expert bytes of a checkpoint, as `moetier info` computes them (no weight is read)."""
    from moetier.models.open import describe  # torch: only the scripts that need it pay for the import

    return int(describe(model).total_expert_bytes)


def machine() -> dict[str, Any]:
    """The CPU model, logical cores and ISA flags detected now (benchmarks.vs_llamacpp.cpu_isa)."""
    from benchmarks.vs_llamacpp import cpu_isa  # imports torch and moetier: only when a report is written

    isa = cpu_isa()
    flags: list[str] = isa["flags"]
    return {"cpu": isa["cpu"], "cores": os.cpu_count(), "isa": flags,
            "avx512": any(f.startswith("avx512") for f in flags), "amx": any(f.startswith("amx") for f in flags),
            "torch_capability": isa["torch_capability"]}  # fmt: skip


def machine_line(m: dict[str, Any]) -> str:
    return (f"cpu: {m['cpu'] or '?'}, {m['cores']} cores; ISA: {' '.join(m['isa']) or '-'}; "
            f"AVX-512: {'yes' if m['avx512'] else 'no'}; AMX: {'yes' if m['amx'] else 'no'}")  # fmt: skip


# ---------------------------------------------------------------- 2. /metrics


async def scrape(client: httpx2.AsyncClient, base: str) -> dict[str, float]:
    """GET /metrics as {"moetier_name{labels}": value}; empty when the server does not answer."""
    try:
        resp = await client.get(f"{base}/metrics", timeout=30)
    except httpx2.HTTPError:
        return {}
    if resp.status_code != 200:
        return {}
    out: dict[str, float] = {}
    for line in resp.text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            with contextlib.suppress(ValueError):
                out[key] = float(value)
    return out


def _label(key: str, label: str) -> str | None:
    _, _, rest = key.partition("{")
    for part in rest.rstrip("}").split(","):
        k, _, v = part.partition("=")
        if k == label:
            return v.strip('"')
    return None


def by_label(m: dict[str, float], name: str, label: str) -> dict[str, float]:
    """{label value: sample} of metric `name` (e.g. expert_hits_total by tier)."""
    out: dict[str, float] = {}
    for key, value in m.items():
        if key.partition("{")[0] == name:
            which = _label(key, label) or ""
            out[which] = out.get(which, 0.0) + value
    return out


def total(m: dict[str, float], name: str) -> float:
    """Metric `name` summed over its labels (0 when absent)."""
    return sum(v for k, v in m.items() if k.partition("{")[0] == name)


def hit_rates(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    """Expert hit rate per tier between two scrapes: delta hits / (delta hits + delta misses); None without
    accesses."""
    hits0, hits1 = (by_label(m, "moetier_expert_hits_total", "tier") for m in (before, after))
    miss0, miss1 = (by_label(m, "moetier_expert_misses_total", "tier") for m in (before, after))
    out: dict[str, float | None] = {}
    for tier in sorted(set(hits1) | set(miss1)):
        h = hits1.get(tier, 0.0) - hits0.get(tier, 0.0)
        n = h + miss1.get(tier, 0.0) - miss0.get(tier, 0.0)
        out[tier] = h / n if n > 0 else None
    return out


# ---------------------------------------------------------------- 3. clients


@dataclass(frozen=True)
class Mix:
    """What the clients send: fractions of streamed, chat and deliberately disconnected requests."""

    stream_fraction: float = 0.5
    chat_fraction: float = 0.5
    disconnect_fraction: float = 0.0
    max_tokens: tuple[int, int] = (32, 32)  # uniform in [lo, hi]
    temperature: float = 0.0
    timeout_s: float = 300.0


@dataclass
class Outcome:
    """One request: status "ok" | "disconnect" | "error" (with `error`, its kind)."""

    start: float  # time.monotonic()
    end: float
    stream: bool
    chat: bool
    status: str
    error: str | None = None
    tokens: int = 0  # completion tokens (usage) of an ok request
    ttft: float | None = None  # streams: seconds to the first event with text
    replica: str | None = None  # the x-moetier-replica response header (Ray replicas), when sent

    @property
    def latency(self) -> float:
        return self.end - self.start


def token_range(text: str) -> tuple[int, int]:
    """argparse type of --max-tokens: "N" or "LO-HI"."""
    lo, _, hi = text.partition("-")
    try:
        a, b = int(lo), int(hi or lo)
    except ValueError:
        a, b = 0, 0
    if not 1 <= a <= b:
        raise argparse.ArgumentTypeError(f"wants N or LO-HI with 1 <= LO <= HI, got {text!r}")
    return a, b


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _body(model: str, rng: random.Random, mix: Mix, stream: bool, chat: bool) -> dict[str, Any]:
    prompt = rng.choice(PROMPTS)
    body: dict[str, Any] = {"model": model, "max_tokens": rng.randint(*mix.max_tokens), "temperature": mix.temperature,
                            "seed": rng.randrange(1 << 30), "stream": stream}  # fmt: skip
    body |= {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def _event_text(event: dict[str, Any]) -> str:
    choices = event.get("choices") or []
    if not choices:
        return ""
    c = choices[0]
    return str(c.get("text") or (c.get("delta") or {}).get("content") or "")


async def _streamed(client: httpx2.AsyncClient, url: str, body: dict[str, Any], cut_after: int | None,
                    t0: float, out: Outcome) -> None:  # fmt: skip
    """Read one SSE response into `out`; with cut_after, close the connection after that many data events."""
    async with client.stream("POST", url, json=body) as resp:
        out.replica = resp.headers.get(REPLICA_HEADER)
        if resp.status_code != 200:
            await resp.aread()
            out.status, out.error = "error", f"http_{resp.status_code}"
            return
        events, done = 0, False
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                break
            try:
                event = json.loads(data)
            except json.JSONDecodeError:
                out.status, out.error = "error", "bad_json"
                return
            if "error" in event:
                out.status, out.error = "error", f"stream_error_{event['error'].get('code') or 'event'}"
                return
            events += 1
            if out.ttft is None and _event_text(event):
                out.ttft = time.monotonic() - t0
            if event.get("usage"):
                out.tokens = int(event["usage"]["completion_tokens"])
            if cut_after is not None and events >= cut_after:
                out.status = "disconnect"  # leaving the block closes the connection mid-stream
                return
        if not done:  # (a stream that ended before its planned cut is a complete response: ok)
            out.status, out.error = "error", "stream_without_done"
        elif out.tokens == 0:
            out.status, out.error = "error", "stream_without_usage"


async def one_request(client: httpx2.AsyncClient, base: str, model: str, rng: random.Random, mix: Mix) -> Outcome:
    """Send one request drawn from `mix`; never raises (except cancellation)."""
    stream, chat = rng.random() < mix.stream_fraction, rng.random() < mix.chat_fraction
    cut = rng.random() < mix.disconnect_fraction
    body = _body(model, rng, mix, stream, chat)
    url = f"{base}/v1/chat/completions" if chat else f"{base}/v1/completions"
    t0 = time.monotonic()
    out = Outcome(t0, t0, stream, chat, "ok")
    try:
        if stream:
            cut_after = rng.randint(1, max(1, body["max_tokens"] // 2)) if cut else None
            await _streamed(client, url, body, cut_after, t0, out)
        else:
            request = client.post(url, json=body)
            if cut:  # a client that gives up: closes the connection after a random delay
                try:
                    resp = await asyncio.wait_for(request, timeout=rng.uniform(0.02, 0.5))
                except TimeoutError:
                    out.status, out.end = "disconnect", time.monotonic()
                    return out
            else:
                resp = await request
            out.replica = resp.headers.get(REPLICA_HEADER)
            if resp.status_code != 200:
                out.status, out.error = "error", f"http_{resp.status_code}"
            else:
                try:
                    data = resp.json()
                    out.tokens = int(data["usage"]["completion_tokens"])
                    _ = data["choices"][0]
                except (ValueError, KeyError, IndexError, TypeError):
                    out.status, out.error = "error", "bad_body"
    except httpx2.HTTPError as exc:
        out.status, out.error = "error", type(exc).__name__
    out.end = time.monotonic()
    return out


@dataclass
class Load:
    """Outcomes of a closed loop, in the order they ended."""

    outcomes: list[Outcome] = field(default_factory=list)
    started: float = 0.0
    ended: float = 0.0


def make_client(clients: int, mix: Mix, api_key: str | None) -> httpx2.AsyncClient:
    limits = httpx2.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    timeout = httpx2.Timeout(mix.timeout_s, connect=30.0)
    return httpx2.AsyncClient(limits=limits, timeout=timeout, headers=auth_headers(api_key))


async def closed_loop(
    client: httpx2.AsyncClient, base: str, model: str, clients: int, seconds: float, mix: Mix, seed: int,
    load: Load | None = None, alive: Callable[[], bool] | None = None,
) -> Load:  # fmt: skip
    """`clients` clients send requests back to back for `seconds`; requests in flight at the deadline finish. No new
    request starts once `alive()` is false (the server died: the run ends instead of counting connection errors)."""
    load = load or Load()
    load.started = time.monotonic()
    deadline = load.started + seconds

    async def client_loop(c: int) -> None:
        rng = random.Random(seed * 1_000_003 + c)
        while time.monotonic() < deadline and (alive is None or alive()):
            load.outcomes.append(await one_request(client, base, model, rng, mix))

    await asyncio.gather(*(client_loop(c) for c in range(clients)))
    load.ended = time.monotonic()
    return load


# ---------------------------------------------------------------- 4. statistics


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]); None for no values."""
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def error_kinds(outcomes: list[Outcome]) -> dict[str, int]:
    kinds: dict[str, int] = {}
    for o in outcomes:
        if o.status == "error":
            kinds[o.error or "?"] = kinds.get(o.error or "?", 0) + 1
    return dict(sorted(kinds.items()))


def fmt(v: float | None, spec: str = ".3f") -> str:
    return "-" if v is None else format(v, spec)


__all__ = [
    "API_KEY_ENV", "BUNDLED_MODEL", "PROMPTS", "REPLICA_HEADER", "Load", "Mix", "Outcome", "Server",
    "ServerStartError", "by_label", "closed_loop", "error_kinds", "exit_on_server_failure", "expert_bytes", "fmt",
    "free_port", "hit_rates",
    "machine", "machine_line", "make_client", "missing_flags", "one_request", "percentile", "rss_bytes",
    "running_server", "scrape", "serve_help", "sigterm_as_interrupt", "tail", "token_range", "total",
]  # fmt: skip
