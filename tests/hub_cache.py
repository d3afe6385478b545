"""A Hugging Face hub cache written by hand, laid out exactly as huggingface_hub lays it out, for offline tests
of hub ids (tests/models/test_hub.py, tests/cli/test_cli_hub.py).

    CACHE/models--OWNER--NAME/blobs/<sha256>            the bytes of each file
    CACHE/models--OWNER--NAME/snapshots/<commit>/<path>  relative symlinks into blobs/
    CACHE/models--OWNER--NAME/refs/<branch>              the commit hash, no newline
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from pathlib import Path


def put_in_cache(
    cache: Path, repo_id: str, files: Mapping[str, bytes | Path], commit: str, ref: str | None = "main"
) -> Path:
    """Cache `files` (repository path -> bytes, or a local file to copy) as snapshot `commit` of `repo_id`, with
    refs/`ref` pointing at it; the snapshot folder."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    for name, content in files.items():
        data = content if isinstance(content, bytes) else content.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.unlink(missing_ok=True)  # a file cached again: the link is renewed, as the hub does
        link.symlink_to(os.path.relpath(blob, link.parent))
    if ref is not None:
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot


def cache_checkpoint(cache: Path, repo_id: str, folder: Path, commit: str, ref: str | None = "main") -> Path:
    """Cache every file of a local checkpoint folder (top level) as a snapshot of `repo_id`."""
    files: dict[str, bytes | Path] = {p.name: p for p in sorted(folder.iterdir()) if p.is_file()}
    return put_in_cache(cache, repo_id, files, commit, ref)
