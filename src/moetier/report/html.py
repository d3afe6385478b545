"""OUT/index.html of `moetier report`: a table of the input's numbers, then one section per figure:
its <img> (a path relative to OUT) or, when its data is absent, the reason it was skipped; and the
hit-rate table (policy x cache ratio) when the trace was replayed.

Invariants: every text is HTML-escaped; the page references exactly the PNGs that were written, by
file name, so OUT can be moved or copied as a whole.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from html import escape
from pathlib import Path

_STYLE = ("body{font-family:sans-serif;max-width:1200px;margin:1em auto;color:#222}"
          "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:3px 8px;text-align:left}"
          "img{max-width:100%;border:1px solid #eee}.skipped{color:#a33;font-style:italic}")  # fmt: skip


@dataclass(frozen=True)
class Figure:
    key: str  # file stem: activation, hit_rate, precision, sparsity, timeline
    title: str
    file: Path | None  # the PNG written, or None when skipped
    reason: str = ""  # why it was skipped


def _table(rows: Sequence[Sequence[str]], header: Sequence[str] = ()) -> str:
    head = "<tr>" + "".join(f"<th>{escape(h)}</th>" for h in header) + "</tr>" if header else ""
    body = "".join("<tr>" + "".join(f"<td>{escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table>{head}{body}</table>"


def write_index(out: Path, name: str, numbers: Sequence[tuple[str, str]], figures: Sequence[Figure],
                hit_table: tuple[list[str], list[list[str]]] | None = None) -> Path:  # fmt: skip
    """Write OUT/index.html; returns its path."""
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>moetier report: {escape(name)}</title>",
             f"<style>{_STYLE}</style></head><body>", f"<h1>moetier report: {escape(name)}</h1>",
             _table(numbers, ("quantity", "value"))]  # fmt: skip
    for fig in figures:
        parts.append(f"<h2 id='{escape(fig.key)}'>{escape(fig.title)}</h2>")
        if fig.file is None:
            parts.append(f"<p class='skipped'>skipped: {escape(fig.reason)}</p>")
            continue
        parts.append(f"<p><img src='{escape(fig.file.name)}' alt='{escape(fig.title)}'></p>")
        if fig.key == "hit_rate" and hit_table is not None:
            parts.append(_table(hit_table[1], hit_table[0]))
    parts.append("</body></html>")
    path = out / "index.html"
    path.write_text("\n".join(parts) + "\n", encoding="utf-8")
    return path


__all__ = ["Figure", "write_index"]
