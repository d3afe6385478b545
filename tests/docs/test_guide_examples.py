"""Every example of the user guide (docs/guide/*.md) runs, and every `moetier` flag it shows exists.

The marker convention is guide_blocks.py's (and docs/guide/README.md's). The pages run two at a time
(this machine has 2 cores; each page's blocks run in order in the page's own temporary folder), once
per session, for the pages whose test was selected.
"""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from guide_blocks import GUIDE, blocks, flag_problems, make_workdir, marker_problems, pages, run_page

PAGES = [p.name for p in pages()]


@functools.cache
def cli_flags() -> dict[str, set[str]]:
    """Command name -> every option string it accepts, from the typer app."""
    from moetier.cli.app import all_commands

    commands = all_commands()
    return {name: {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)} for name, cmd in commands.items()}


@pytest.fixture(scope="session")
def page_failures(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[str]]:
    """Page name -> failure messages of its runnable blocks; the selected pages run 2 at a time."""
    selected = [item for item in request.session.items if hasattr(item, "callspec")]
    test_name = "test_guide_page_examples_run"
    wanted = sorted({i.callspec.params["page"] for i in selected if getattr(i, "originalname", "") == test_name})

    def cost(name: str) -> int:  # processes a page starts: the longest pages start first
        return sum(b.code.count("moetier ") + (b.lang == "python") for b in blocks(GUIDE / name) if b.kind == "run")

    wanted.sort(key=cost, reverse=True)

    # work folders made here, in one thread: pytest's first mktemp of a session creates its base folder, and
    # two threads racing to do that each make one (then one thread's folder is "not relative" to the base)
    workdirs = {name: make_workdir(tmp_path_factory.mktemp(Path(name).stem)) for name in wanted}

    def one(name: str) -> list[str]:
        return run_page(GUIDE / name, workdirs[name])

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(wanted, pool.map(one, wanted), strict=True))


def test_the_guide_has_its_pages() -> None:
    expected = {"README.md", "quickstart.md", "real-checkpoints.md", "cli.md", "python-api.md", "add-a-family.md",
                "add-a-policy.md", "add-a-scheduler.md", "new-machine.md", "serving.md", "reports.md"}  # fmt: skip
    assert expected <= set(PAGES)


def test_index_links_every_page() -> None:
    index = (GUIDE / "README.md").read_text(encoding="utf-8")
    missing = [p for p in PAGES if p != "README.md" and f"({p})" not in index]
    assert not missing, f"docs/guide/README.md does not link {missing}"


@pytest.mark.parametrize("page", PAGES)
def test_guide_page_blocks_are_marked(page: str) -> None:
    problems = marker_problems(GUIDE / page)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("page", [p for p in PAGES if p not in ("README.md", "cli.md")])
def test_guide_page_has_a_runnable_example(page: str) -> None:
    assert any(b.kind == "run" for b in blocks(GUIDE / page)), f"docs/guide/{page} has no <!-- run --> block"


@pytest.mark.parametrize("page", PAGES)
def test_guide_page_moetier_flags_exist(page: str) -> None:
    """Run or skipped, every `moetier COMMAND --flag` in a bash block is a real command and flag."""
    flags = cli_flags()
    bash = [b for b in blocks(GUIDE / page) if b.lang == "bash"]
    problems = [p for b in bash for p in flag_problems(b, flags)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("page", PAGES)
def test_guide_page_skipped_python_compiles(page: str) -> None:
    for b in blocks(GUIDE / page):
        if b.lang == "python" and b.kind == "skip":
            compile(b.code, b.where, "exec")  # a SyntaxError names the page and line


@pytest.mark.parametrize("page", PAGES)
def test_guide_page_examples_run(page: str, page_failures: dict[str, list[str]]) -> None:
    failures = page_failures[page]
    assert not failures, "\n\n".join(failures)


def test_flag_check_catches_a_wrong_flag() -> None:
    """The checker itself: a misspelt flag and an unknown command are reported with file and line."""
    from guide_blocks import Block

    bad = Block(GUIDE / "quickstart.md", 7, "bash", "moetier generate m --prompt x --host-mem 4MiB \\\n  --json\n"
                "moetier frobnicate --x\n", "run")  # fmt: skip
    problems = flag_problems(bad, cli_flags())
    assert any("--host-mem" in p and "quickstart.md:7" in p for p in problems)
    assert any("frobnicate" in p for p in problems)
    assert not any("--json" in p or "--prompt" in p for p in problems)


def test_unmarked_block_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import guide_blocks

    monkeypatch.setattr(guide_blocks, "ROOT", tmp_path)
    page = tmp_path / "p.md"
    page.write_text("text\n\n```bash\nmoetier --help\n```\n\nno note\n<!-- skip: needs a GPU -->\n```bash\nx\n```\n")
    problems = marker_problems(page)
    assert any("p.md:3" in p and "without" in p for p in problems)
    assert any("p.md:9" in p and "visible note" in p for p in problems)
