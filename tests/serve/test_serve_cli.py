"""`moetier serve`: bad flags are one-line errors (exit 2) before anything listens; a real server
process answers the openai client and exits 0 on Ctrl-C (SIGINT)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx2
import openai
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
        deadline = time.monotonic() + 60
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
