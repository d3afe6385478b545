"""How sweep points run (sweep.py): one point never raising (`run_point`), the record file
OUT/points.jsonl (read back tolerating a torn last line, appended one flushed line per point), and the
two parallel runners: a process pool (concurrent.futures, fork on Linux) and a Ray cluster.

Invariants: nothing here knows what a point computes; a point's exception is an error outcome, while a
worker that dies yields outcome None (a lost point, not recorded, retried by the next run); ray is
imported only by `run_ray`; a runner starts its progress (on_start) only after its workers exist.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from pathlib import Path
from typing import Any

from moetier.errors import ConfigError

RECORDS = "points.jsonl"
Todo = list[tuple[str, dict[str, Any], dict[str, Any]]]  # (key, given params, full params)


def _flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, Mapping):
            out.update(_flatten(v, f"{prefix}{k}_"))
        else:
            out[f"{prefix}{k}"] = list(v) if isinstance(v, tuple) else v
    return out


def run_point(fn: Callable[[dict[str, Any]], dict[str, Any]], params: dict[str, Any]) -> dict[str, Any]:
    """One point, never raising: {status: ok | error, error, seconds, result}."""
    t0 = time.perf_counter()
    try:
        result, status, error = _flatten(fn(dict(params))), "ok", None
        json.dumps(result)
    except Exception as exc:
        result, status, error = {}, "error", f"{type(exc).__name__}: {exc}"
    return {"status": status, "error": error, "seconds": time.perf_counter() - t0, "result": result}


def read_records(out: Path) -> dict[str, dict[str, Any]]:
    """key -> the last well-formed record in OUT/points.jsonl (a torn last line is ignored: it reruns)."""
    path, records = out / RECORDS, {}
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict) and isinstance(rec.get("key"), str):
                records[rec["key"]] = rec
    return records


class Appender:
    """Appends records to points.jsonl, one flushed line each, after repairing a torn last line."""

    def __init__(self, path: Path) -> None:
        torn = path.is_file() and path.stat().st_size > 0 and not path.read_bytes().endswith(b"\n")
        self.f = path.open("a", encoding="utf-8")
        if torn:
            self.f.write("\n")

    def write(self, rec: dict[str, Any]) -> None:
        self.f.write(json.dumps(rec, default=str) + "\n")
        self.f.flush()
        os.fsync(self.f.fileno())

    def close(self) -> None:
        self.f.close()


Done = Callable[[str, dict[str, Any], dict[str, Any] | None], None]  # key, given params, outcome (None: lost)


def _die_with_parent() -> None:
    """Pool worker initializer (Linux): SIGTERM this worker when the sweep process dies, even by SIGKILL,
    so a killed sweep leaves no workers behind."""
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def run_pool(fn: Any, todo: Todo, jobs: int, done: Done, on_start: Callable[[int], None]) -> None:
    """Run `todo` on `jobs` worker processes; done(key, given, outcome) in the order they finish."""
    import multiprocessing as mp

    linux = sys.platform == "linux"
    ctx = mp.get_context("fork") if linux else None
    with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx, initializer=_die_with_parent if linux else None) as pool:
        futures: dict[Future[dict[str, Any]], tuple[str, dict[str, Any]]] = {
            pool.submit(run_point, fn, full): (key, given) for key, given, full in todo
        }
        on_start(len(todo))  # after the workers are forked (a progress thread may start now)
        try:
            pending = set(futures)
            while pending:
                finished, pending = wait(pending, return_when=FIRST_COMPLETED)
                for fut in finished:
                    key, given = futures[fut]
                    done(key, given, None if fut.exception() else fut.result())
        except BaseException:
            pool.shutdown(wait=False, cancel_futures=True)
            raise


def run_ray(fn: Any, todo: Todo, address: str, jobs: int | None, done: Done, on_start: Callable[[int], None]) -> None:
    """Run `todo` as Ray tasks (one CPU each) at `address` ("local": a local instance with `jobs` CPUs,
    default all); a Ray instance already initialised in this process is used as it is and left running."""
    try:
        import ray
    except ImportError:
        raise ConfigError("--ray needs the ray package: pip install 'moetier[sweep]'") from None
    started = not ray.is_initialized()
    if started:
        try:
            if address == "local":
                ray.init(num_cpus=jobs, include_dashboard=False, log_to_driver=False)
            else:
                ray.init(address=address, log_to_driver=False)
        except Exception as exc:
            raise ConfigError(f"cannot start or reach Ray at {address!r}: {exc}") from None
    try:
        remote = ray.remote(num_cpus=1)(run_point)
        refs = {remote.remote(fn, full): (key, given) for key, given, full in todo}
        on_start(len(todo))
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            for ref in ready:
                key, given = refs[ref]
                try:
                    outcome = ray.get(ref)
                except Exception:
                    outcome = None
                done(key, given, outcome)
    finally:
        if started:
            ray.shutdown()


__all__ = ["RECORDS", "Appender", "Done", "Todo", "read_records", "run_point", "run_pool", "run_ray"]
