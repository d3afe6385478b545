"""Extract and run the examples of the user guide (docs/guide/*.md); shared by tests/docs/test_guide_*.py.

Marker convention (documented in docs/guide/README.md): an HTML comment on the line right before a fence.
    <!-- run -->              the ```bash or ```python block below is run by the tests
    <!-- run: background -->  a ```bash block that starts a server: started in the background, the
                              tests wait for GET /health on its --port, run the page's later blocks,
                              then stop it with Ctrl-C (SIGINT)
    <!-- file: NAME -->        the block's text is written to NAME in the page's folder before the
                              page's later blocks run (a profile .json, a sweep .toml)
    <!-- skip: REASON -->     not run (needs a GPU, a Hub checkpoint, minutes); the line before the
                              comment must be a visible note starting with "> Not run by the tests"
Every ```bash and ```python fence needs one of run / run: background / skip. All blocks of a page run
in order, in one temporary folder where models/ and data/ link to the repository's,
with HF_HUB_OFFLINE=1 and OMP_NUM_THREADS=1; bash runs with `set -eo pipefail`, python as a script.
The port 8000 of a page with a background block is replaced by a free port in all its blocks.

Invariants: extraction is pure text (no import of moetier), every block knows its file and 1-based line
(the fence's), and a failure message names both.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "guide"
LINKED = ("models", "data")
RUNNABLE_LANGS = ("bash", "python")
NOTE = "> Not run by the tests"
MARKER = re.compile(r"^<!--\s*(run|run: background|skip: .+|file: \S+)\s*-->$")
FENCE = re.compile(r"^```(\w*)")
# bounds for a loaded machine, not expected times: the pages run two at a time on 2 cores, and a loaded machine
# (load average 7) took 34 s to start a server that takes 3 s alone
BLOCK_TIMEOUT_S = 300
HEALTH_TIMEOUT_S = 180


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    marker: str | None  # "run", "run: background", "skip: ...", "file: NAME" or None

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def kind(self) -> str:
        return "none" if self.marker is None else self.marker.split(":")[0] if ":" in self.marker else self.marker


def pages() -> list[Path]:
    return sorted(GUIDE.glob("*.md"))


def blocks(path: Path) -> list[Block]:
    """Every fenced block of a page with the marker on the line before it (if any)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, lang = i, m.group(1)
        j = i + 1
        while j < len(lines) and not lines[j].startswith("```"):
            j += 1
        prev = lines[start - 1].strip() if start > 0 else ""
        mk = MARKER.match(prev)
        out.append(Block(path, start + 1, lang, "\n".join(lines[start + 1 : j]) + "\n", mk.group(1) if mk else None))
        i = j + 1
    return out


def marker_problems(path: Path) -> list[str]:
    """Unmarked bash/python blocks, skip markers without a visible note, misplaced markers."""
    lines = path.read_text(encoding="utf-8").splitlines()
    problems = []
    for b in blocks(path):
        if b.lang in RUNNABLE_LANGS and b.kind not in ("run", "skip"):
            problems.append(f"{b.where}: ```{b.lang} block without <!-- run --> or <!-- skip: REASON -->")
        if b.kind == "skip":
            note = lines[b.line - 3].strip() if b.line >= 3 else ""
            if not note.startswith(NOTE):
                problems.append(f"{b.where}: skipped block needs a visible note line '{NOTE}: ...' before its marker")
        if b.kind == "run" and b.lang not in RUNNABLE_LANGS:
            problems.append(f"{b.where}: <!-- run --> on a ```{b.lang} block (only bash and python run)")
    return problems


def moetier_calls(code: str) -> list[list[str]]:
    """The argv (after `moetier`) of every `moetier ...` command in a bash block."""
    calls = []
    for raw in code.replace("\\\n", " ").splitlines():
        try:
            words = shlex.split(raw, comments=True)
        except ValueError:
            words = raw.split()
        for k, w in enumerate(words):
            if w == "moetier":
                rest = []
                for x in words[k + 1 :]:
                    if x in ("|", "&&", "||", ";", "&", ">", "2>", ">>"):
                        break
                    rest.append(x)
                calls.append(rest)
    return calls


def flag_problems(block: Block, commands: dict[str, set[str]]) -> list[str]:
    """Unknown commands or flags in a block's moetier calls (commands: name -> every option string)."""
    problems = []
    for argv in moetier_calls(block.code):
        if not argv or argv[0].startswith("--"):
            bad = [a for a in argv if a.startswith("--") and a not in ("--help", "--version")]
            problems += [f"{block.where}: moetier {a}: unknown top-level flag" for a in bad]
            continue
        name = argv[0]
        if name not in commands:
            problems.append(f"{block.where}: moetier {name}: no such command (known: {', '.join(sorted(commands))})")
            continue
        for a in argv[1:]:
            if a.startswith("--") and a.split("=")[0] not in commands[name] | {"--help"}:
                problems.append(f"{block.where}: moetier {name} {a.split('=')[0]}: no such flag")
    return problems


def free_port() -> int:
    """A port free now, bound again later by the page's server: a race with any process that takes it meanwhile
    (the server then fails at once, `cannot listen on ...`). Kept because the page's blocks are the guide's
    text: its server runs with `--log-level warning`, so `--port 0` would not log the port it got (uvicorn says it
    at info only), and the later blocks need the number."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_workdir(tmp: Path) -> Path:
    for name in LINKED:
        (tmp / name).symlink_to(ROOT / name, target_is_directory=True)
    return tmp


def env() -> dict[str, str]:
    bindir = str(Path(sys.executable).parent)
    return os.environ | {
        "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1", "PATH": bindir + os.pathsep + os.environ.get("PATH", ""),
        "COLUMNS": "100",
    }  # fmt: skip


def _tail(text: str, n: int = 3000) -> str:
    return text if len(text) <= n else "...\n" + text[-n:]


def _failed(b: Block, what: str, out: str, err: str) -> str:
    body = f"--- block ---\n{b.code}--- stdout ---\n{_tail(out)}\n--- stderr ---\n{_tail(err)}"
    return f"{b.where}: {b.lang} block {what}\n{body}"


def _wait_health(port: int, proc: subprocess.Popen[str], b: Block) -> str | None:
    deadline = time.monotonic() + HEALTH_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            out, err = proc.communicate()
            return _failed(b, f"(background) exited with {proc.returncode} before /health answered", out, err)
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                if r.status == 200:
                    return None
        except OSError:
            pass
        time.sleep(0.2)
    return _failed(b, f"(background): no /health on port {port} within {HEALTH_TIMEOUT_S} s", "", "")


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()


def run_page(path: Path, workdir: Path) -> list[str]:
    """Run every run/file block of a page in order in workdir; the failures (empty list: all passed)."""
    todo = [b for b in blocks(path) if b.kind in ("run", "file")]
    port = free_port() if any(b.marker == "run: background" for b in todo) else None
    servers: list[subprocess.Popen[str]] = []
    e = env()
    try:
        for b in todo:
            code = re.sub(r"\b8000\b", str(port), b.code) if port else b.code
            if b.kind == "file":
                (workdir / str(b.marker).split(":", 1)[1].strip()).write_text(code, encoding="utf-8")
                continue
            argv = ["bash", "-eo", "pipefail", "-c", code] if b.lang == "bash" else [sys.executable, "-c", code]
            if b.marker == "run: background":
                proc = subprocess.Popen(argv, cwd=workdir, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True, start_new_session=True)  # fmt: skip
                servers.append(proc)
                assert port is not None
                problem = _wait_health(port, proc, b)
                if problem:
                    return [problem]
                continue
            try:
                done = subprocess.run(argv, cwd=workdir, env=e, capture_output=True, text=True,
                                      timeout=BLOCK_TIMEOUT_S)  # fmt: skip
            except subprocess.TimeoutExpired as exc:
                out, err = str(exc.stdout or ""), str(exc.stderr or "")
                return [_failed(b, f"timed out after {BLOCK_TIMEOUT_S} s", out, err)]
            if done.returncode != 0:
                return [_failed(b, f"failed with exit code {done.returncode}", done.stdout, done.stderr)]
    finally:
        for proc in servers:
            _stop(proc)
    return []


__all__ = ["Block", "blocks", "flag_problems", "make_workdir", "marker_problems", "moetier_calls", "pages",
           "run_page"]  # fmt: skip
