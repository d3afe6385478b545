"""`moetier serve`: bad flags are one-line errors (exit 2) before anything listens; a real server
process answers the openai client and exits 0 on Ctrl-C (SIGINT)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import httpx2
import openai
import pytest
from typer.testing import CliRunner

from moetier.cli.app import app
from serve.conftest import MODEL, NAME

runner = CliRunner()


def test_bad_flags_exit_2() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        res = runner.invoke(app, ["serve", str(MODEL), "--port", str(port)])
    assert res.exit_code == 2 and "cannot listen on" in res.stderr
    res = runner.invoke(app, ["serve", str(MODEL), "--cache-policy", "nope", "--port", "0"])
    assert res.exit_code == 2 and "unknown cache policy" in res.stderr
    res = runner.invoke(app, ["serve", str(MODEL), "--max-batch", "0"])
    assert res.exit_code == 2


def test_serve_process_answers_and_stops_on_ctrl_c() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = os.environ | {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "moetier.cli", "serve", str(MODEL), "--port", str(port), "--max-batch", "4",
           "--log-level", "warning"]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180  # a loaded machine (load average 7) took 34 s to start it
        while True:
            assert proc.poll() is None, proc.communicate()[1]
            try:
                if httpx2.get(f"http://127.0.0.1:{port}/health", timeout=1).json()["status"] == "ok":
                    break
            except httpx2.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=30)
        out = client.completions.create(model=NAME, prompt="ROMEO:", max_tokens=4, temperature=0)
        assert out.usage is not None and out.usage.completion_tokens >= 1
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
        assert "Traceback" not in err and "server stopped" in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_server_flags_map_onto_one_serve_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every server flag reaches ServeConfig (uvicorn.run replaced: nothing listens); the key comes from
    MOETIER_API_KEY unless --api-key says otherwise, and is never printed."""
    from moetier.runtime.batch import BatchConfig
    from moetier.serve.worker import WorkerLimits

    seen: dict[str, Any] = {}
    monkeypatch.setattr("moetier.cli.serve.uvicorn.run", lambda app, **kw: seen.update(app=app, **kw))
    monkeypatch.setenv("MOETIER_API_KEY", "key-from-env")
    flags = ["serve", str(MODEL), "--port", "0", "--dtype", "fp32", "--max-batch", "3", "--max-queue", "5",
             "--kv-budget", "512MiB", "--queue-timeout", "2.5", "--request-timeout", "60", "--batch-invariant",
             "--max-body", "1MiB", "--read-timeout", "7"]  # fmt: skip
    res = runner.invoke(app, flags)
    assert res.exit_code == 0, res.output
    config = seen["app"].state.config
    assert config.batch == BatchConfig(max_batch=3, kv_budget_bytes=512 << 20, batch_invariant=True)
    assert config.limits == WorkerLimits(max_queue=5, queue_timeout_s=2.5, request_timeout_s=60.0)
    assert (config.max_body_bytes, config.read_timeout_s, config.model_name) == (1 << 20, 7.0, None)
    assert config.api_key == "key-from-env" and "key-from-env" not in res.output + repr(config)
    assert seen["timeout_keep_alive"] == 5 and seen["limit_concurrency"] >= 64
    res = runner.invoke(app, [*flags, "--api-key", "key-from-flag"])
    assert res.exit_code == 0 and seen["app"].state.config.api_key == "key-from-flag"  # the flag wins
    monkeypatch.delenv("MOETIER_API_KEY")
    res = runner.invoke(app, ["serve", str(MODEL), "--port", "0"])
    assert res.exit_code == 0 and seen["app"].state.config.api_key is None  # default: no key
    assert seen["app"].state.config.max_body_bytes == 8 << 20 and seen["app"].state.config.read_timeout_s == 30


def test_bad_server_limit_flags_exit_2() -> None:
    for bad in (["--kv-budget", "lots"], ["--max-body", "-1"], ["--read-timeout", "0"], ["--queue-timeout", "-1"],
                ["--request-timeout", "0"], ["--api-key", "  "], ["--max-body", "0"]):  # fmt: skip
        res = runner.invoke(app, ["serve", str(MODEL), "--port", "0", *bad])
        assert res.exit_code == 2, (bad, res.output)


def test_ray_flags_need_ray_and_refuse_what_replicas_cannot_do(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    res = runner.invoke(app, ["serve", str(MODEL), "--port", "0", "--replicas", "2"])
    assert res.exit_code == 2 and "need --ray ADDRESS" in res.stderr
    res = runner.invoke(app, ["serve", str(MODEL), "--port", "0", "--ray", "local", "--trace", str(tmp_path / "t")])
    assert res.exit_code == 2 and "--trace is not supported with --ray" in res.stderr
    # Ray Serve missing: a one-line error naming the extra to install, before anything connects
    monkeypatch.setitem(sys.modules, "ray", None)
    monkeypatch.setitem(sys.modules, "moetier.serve.ray_deploy", None)
    res = runner.invoke(app, ["serve", str(MODEL), "--port", "0", "--ray", "local", "--replicas", "2"])
    assert res.exit_code == 2 and "moetier[serve-ray]" in res.stderr
