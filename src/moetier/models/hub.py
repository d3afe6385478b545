"""Hugging Face hub ids as MODEL: `owner/name[@revision][:selector]` -> a folder (or .gguf file) in the hub's cache.

`resolve_model(spec)` turns what a user typed as MODEL into a local path:
- a path that exists (folder or file) is returned as it is: no network, no cache;
- `owner/name` (optionally `@revision`, a branch, tag or commit) is a model repository on the Hugging Face
  hub, fetched with huggingface_hub's own `snapshot_download` into its own cache (HF_HUB_CACHE / HF_HOME), of
  only the files moetier reads (CHECKPOINT_FILES and CHECKPOINT_GLOBS, at the top of the repository); the
  snapshot folder is returned;
- `owner/name:Q4_K_M` selects the GGUF file(s) of the repository whose path holds that quant tag
  (case-insensitive, as a whole word: `Q4_K_M` does not pick `IQ4_K_M`); the shards of a split file
  (`*-00001-of-00003.gguf`) go together. `owner/name:file.gguf` names one file exactly (its shards come
  along). The path of the (first) .gguf file is returned.
- anything else is a ConfigError saying it is neither an existing path nor a hub id.

Invariants:
- offline (HF_HUB_OFFLINE=1, `offline=True`, or the hub unreachable) nothing is requested from the network:
  the cache is read with `local_files_only=True`, and a snapshot that is not cached, or lacks a file moetier
  needs (config.json, a weight shard the index names, a GGUF shard), is a CheckpointError naming the repository,
  the revision and the missing files;
- online, the size of what will be downloaded (the selected files not yet in the cache, from
  `HfApi.model_info(files_metadata=True)`) is reported through `log` before any byte is downloaded;
- no process-wide setting is read or changed here other than huggingface_hub's own (its cache location and
  offline mode, read when `cache_dir` / `offline` are left out).
"""

from __future__ import annotations

import fnmatch
import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import huggingface_hub.constants as hub_constants
from huggingface_hub import HfApi, snapshot_download
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.file_download import repo_folder_name
from huggingface_hub.utils import tqdm as hub_tqdm

from moetier.config import format_size
from moetier.errors import CheckpointError, ConfigError

# The files of a checkpoint repository moetier reads (top level only: `original/` copies and the like are skipped).
CHECKPOINT_FILES = (
    "config.json", "generation_config.json", "model.safetensors.index.json", "moetier.json",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "vocab.txt", "merges.txt", "chat_template.jinja", "chat_template.json",
)  # fmt: skip
CHECKPOINT_GLOBS = ("*.safetensors", "*.model")  # weights; SentencePiece tokenizers (tokenizer.model)
INDEX_FILE = "model.safetensors.index.json"
SPEC_FORM = "owner/name[@revision][:QUANT|:FILE.gguf]"

_NAME = r"[A-Za-z0-9][A-Za-z0-9_.-]{0,95}"
_SPEC = re.compile(rf"(?P<repo>{_NAME}/{_NAME})(?:@(?P<revision>[^:@\s]+))?(?::(?P<selector>[^:@\s]+))?")
_SHARD = re.compile(r"(?P<stem>.+)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf", re.IGNORECASE)

Log = Callable[[str], None]


def _quiet(_message: str) -> None:
    """The default `log`: say nothing."""


@dataclass(frozen=True)
class HubSpec:
    """A parsed hub id: the repository, its revision (None = the default branch) and the GGUF selector."""

    repo_id: str
    revision: str | None = None
    selector: str | None = None

    def __str__(self) -> str:
        rev = f"@{self.revision}" if self.revision else ""
        sel = f":{self.selector}" if self.selector else ""
        return f"{self.repo_id}{rev}{sel}"

    @property
    def slug(self) -> str:
        """`owner--name` (as the hub's cache names its folders), a file-name-safe key of the repository."""
        return self.repo_id.replace("/", "--")


def parse_hub_spec(text: str) -> HubSpec | None:
    """`owner/name[@revision][:selector]` -> HubSpec; None when `text` does not have that shape."""
    m = _SPEC.fullmatch(text.strip())
    if m is None:
        return None
    repo = m["repo"]
    if "--" in repo or ".." in repo or repo.endswith((".git", ".")):  # refused by the hub itself
        return None
    return HubSpec(repo, m["revision"], m["selector"])


def hub_spec(spec: str) -> HubSpec | None:
    """None when `spec` names an existing path (which always wins), its HubSpec when it is id-shaped;
    otherwise a ConfigError saying it is neither."""
    if Path(spec).expanduser().exists():
        return None
    parsed = parse_hub_spec(spec)
    if parsed is None:
        raise ConfigError(
            f"MODEL {spec!r} is neither an existing path nor a Hugging Face hub id ({SPEC_FORM}, e.g. "
            "Qwen/Qwen3-30B-A3B or unsloth/Qwen3-30B-A3B-GGUF:Q4_K_M)"
        )
    return parsed


# -- which files ---------------------------------------------------------------------------
def checkpoint_files(paths: Iterable[str]) -> list[str]:
    """The files of a checkpoint repository moetier reads: CHECKPOINT_FILES and CHECKPOINT_GLOBS at the top
    level; with a sharded index, not the `consolidated*` single-file copies some repositories also carry."""
    top = [p for p in paths if "/" not in p]
    chosen = [p for p in top if p in CHECKPOINT_FILES or any(fnmatch.fnmatch(p, g) for g in CHECKPOINT_GLOBS)]
    if INDEX_FILE in chosen:
        chosen = [p for p in chosen if not p.startswith("consolidated")]
    return sorted(chosen)


def _group_key(path: str) -> tuple[str, int]:
    """(stem, shard count) of a split GGUF file; (path, 1) of a single one."""
    m = _SHARD.fullmatch(path)
    return (m["stem"], int(m["count"])) if m else (path, 1)


def _shard_name(stem: str, index: int, count: int) -> str:
    return f"{stem}-{index:05d}-of-{count:05d}.gguf"


def _is_projector(path: str) -> bool:
    """Multimodal projector files (mmproj-*.gguf) are not language models."""
    return path.rsplit("/", 1)[-1].lower().startswith("mmproj")


def gguf_files(paths: Iterable[str], selector: str, where: str) -> list[str]:
    """The GGUF file(s) `selector` picks among `paths` (repository paths), first shard first.

    `selector` is a file name (ends in .gguf: that file, its shards with it) or a quant tag matched as a whole
    word, case-insensitively, against each path. ConfigError when nothing or more than one file (or shard set)
    matches, naming the candidates; CheckpointError when a shard of the chosen set is not in `paths`."""
    ggufs = sorted(p for p in paths if p.lower().endswith(".gguf"))
    if not ggufs:
        raise ConfigError(f"{where} holds no .gguf file (selector {selector!r})")
    if selector.lower().endswith(".gguf"):
        hits = [p for p in ggufs if p == selector] or [p for p in ggufs if p.rsplit("/", 1)[-1] == selector]
    else:
        tag = re.compile(rf"(?<![a-z0-9]){re.escape(selector.lower())}(?![a-z0-9])")
        hits = [p for p in ggufs if tag.search(p.lower()) and not _is_projector(p)]
    groups = sorted({_group_key(p) for p in hits})
    if not groups:
        names = ", ".join(sorted({_group_key(p)[0].rsplit("/", 1)[-1] for p in ggufs if not _is_projector(p)}))
        raise ConfigError(f"{where}: no GGUF file matches {selector!r}; it has: {names}")
    if len(groups) > 1:
        names = ", ".join(stem if count == 1 else _shard_name(stem, 1, count) for stem, count in groups)
        raise ConfigError(f"{where}: {selector!r} matches more than one GGUF file: {names}; name one exactly "
                          "(REPO:FILE.gguf)")  # fmt: skip
    stem, count = groups[0]
    if count == 1:
        return [stem]
    wanted = [_shard_name(stem, i, count) for i in range(1, count + 1)]
    present = set(ggufs)
    if missing := [p for p in wanted if p not in present]:
        raise CheckpointError(f"{where}: {len(missing)} of the {count} shards of {wanted[0]} are missing: "
                              f"{', '.join(missing)}")  # fmt: skip
    return wanted


def select_files(spec: HubSpec, paths: Iterable[str], where: str) -> list[str]:
    """The repository files moetier needs for `spec`: the selected GGUF file(s), else checkpoint_files."""
    if spec.selector is not None:
        return gguf_files(paths, spec.selector, where)
    return checkpoint_files(paths)


# -- the cache -----------------------------------------------------------------------------
def _cache_root(cache_dir: str | Path | None) -> Path:
    return Path(cache_dir if cache_dir is not None else hub_constants.HF_HUB_CACHE).expanduser()


def _snapshot_dir(cache: Path, repo_id: str, commit: str) -> Path:
    return cache / repo_folder_name(repo_id=repo_id, repo_type="model") / "snapshots" / commit


def _local_files(folder: Path) -> list[str]:
    """Repository paths of the files of a snapshot folder (dangling links, i.e. missing blobs, left out)."""
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


def _check_checkpoint(folder: Path, where: str, hint: str) -> None:
    """CheckpointError naming what a checkpoint snapshot lacks (config.json, the shards its index names, or any
    *.safetensors), followed by `hint`."""
    missing = [] if (folder / "config.json").is_file() else ["config.json"]
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{where}: {index}: not a safetensors index ({exc})") from None
        missing += [s for s in shards if not (folder / s).is_file()]
    elif not any(p.is_file() for p in folder.glob("*.safetensors")):
        missing.append("*.safetensors")
    if missing:
        raise CheckpointError(f"{where}: the snapshot {folder} lacks {', '.join(missing)}; {hint}")


@dataclass(frozen=True)
class _Offline:
    """Why the cache is read without the network: said in every error of the offline path."""

    why: str


def _not_cached(spec: HubSpec, cache: Path, offline: _Offline) -> CheckpointError:
    rev = f" --revision {spec.revision}" if spec.revision else ""
    return CheckpointError(
        f"{spec}: no such local path, and hub model {spec.repo_id} (revision {spec.revision or 'main'}) is not in "
        f"the Hugging Face cache {cache}; {offline.why}. Run the command once with network access, or "
        f"`hf download {spec.repo_id}{rev}`"
    )


def _resolve_cached(spec: HubSpec, cache: Path, offline: _Offline) -> Path:
    """The cached snapshot of `spec` (read with local_files_only=True), checked complete for what moetier needs."""
    try:
        folder = Path(snapshot_download(spec.repo_id, revision=spec.revision, cache_dir=cache, local_files_only=True))
    except LocalEntryNotFoundError as exc:
        # huggingface_hub >= 2 refuses a snapshot its cached listing says is incomplete, counting files moetier
        # never reads (other quants, original/): take its folder and check what moetier needs below.
        partial = getattr(exc, "snapshot_path", None)
        if partial is None:
            raise _not_cached(spec, cache, offline) from None
        folder = Path(partial)
    where = f"{spec} ({offline.why})"
    if spec.selector is None:
        _check_checkpoint(folder, str(spec), f"{offline.why}: run the command once with network access to "
                                             "complete it")  # fmt: skip
        return folder
    return folder / gguf_files(_local_files(folder), spec.selector, where)[0]


# -- online --------------------------------------------------------------------------------
class _SilentTqdm(hub_tqdm):
    """huggingface_hub's progress bar, disabled (progress=False)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["disable"] = True
        super().__init__(*args, **kwargs)


def _model_info(spec: HubSpec) -> tuple[str, dict[str, int | None]] | _Offline:
    """(commit, {repository path: size}) from the hub, or why the hub cannot be asked (then the cache is read);
    a repository or revision the hub does not have is a CheckpointError."""
    try:
        info = HfApi().model_info(spec.repo_id, revision=spec.revision, files_metadata=True)
    except GatedRepoError:
        raise CheckpointError(f"{spec}: hub model {spec.repo_id} is gated: accept its terms on huggingface.co, then "
                              "log in (`hf auth login`) or set HF_TOKEN") from None  # fmt: skip
    except RepositoryNotFoundError:
        raise CheckpointError(f"{spec}: no such local path, and no model {spec.repo_id} on the Hugging Face hub "
                              "(a private one needs `hf auth login` or HF_TOKEN)") from None  # fmt: skip
    except RevisionNotFoundError:
        raise CheckpointError(f"{spec}: hub model {spec.repo_id} has no revision {spec.revision!r}") from None
    except OfflineModeIsEnabled:
        return _Offline("HF_HUB_OFFLINE is set")
    except (HfHubHTTPError, OSError) as exc:  # the hub down, a proxy, no route
        return _Offline(f"the hub is unreachable: {type(exc).__name__}: {exc}")
    except Exception as exc:  # the connection errors of huggingface_hub's HTTP client (httpx) are not OSErrors
        if not {c.__name__ for c in type(exc).__mro__} & {"TransportError", "TimeoutException", "NetworkError"}:
            raise
        return _Offline(f"the hub is unreachable: {type(exc).__name__}: {exc}")
    sizes = {s.rfilename: s.size for s in info.siblings or []}
    return str(info.sha), sizes


def download_plan(spec: HubSpec, files: list[str], sizes: dict[str, int | None], cached: Path) -> str:
    """The line said before a download: how many of `files` are fetched and their size (the ones already in the
    snapshot folder `cached` are not counted)."""
    todo = [f for f in files if not (cached / f).is_file()]
    total = sum(sizes.get(f) or 0 for f in todo)
    unknown = sum(1 for f in todo if sizes.get(f) is None)
    size = format_size(total) + (f" + {unknown} file(s) of unknown size" if unknown else "")
    have = len(files) - len(todo)
    kept = f"; {have} already cached" if have else ""
    return f"{spec}: downloading {size} ({len(todo)} of {len(files)} files{kept}) into {cached.parents[2]}"


def resolve_model(
    spec: str,
    *,
    offline: bool | None = None,
    cache_dir: str | Path | None = None,
    progress: bool = True,
    log: Log = _quiet,
) -> Path:
    """MODEL -> local path: `spec` itself when it exists; for a hub id the snapshot folder in huggingface_hub's
    cache (or, with a GGUF selector, the path of the selected .gguf file, the first shard of a split one).

    offline: None = huggingface_hub's own setting (HF_HUB_OFFLINE); True reads only the cache.
    cache_dir: the hub cache; None = huggingface_hub's (HF_HUB_CACHE, else HF_HOME/hub).
    progress: show huggingface_hub's download progress bar (on stderr).
    log: receives the download-size line before a download and the note when the hub is unreachable."""
    parsed = hub_spec(spec)
    if parsed is None:
        return Path(spec).expanduser()
    cache = _cache_root(cache_dir)
    if offline is None:
        offline = hub_constants.HF_HUB_OFFLINE
    if offline:
        return _resolve_cached(parsed, cache, _Offline("HF_HUB_OFFLINE is set"))
    answer = _model_info(parsed)
    if isinstance(answer, _Offline):
        log(f"{parsed}: {answer.why}; reading the cache")
        return _resolve_cached(parsed, cache, answer)
    commit, sizes = answer
    files = select_files(parsed, sizes, f"hub model {parsed}")
    if not files:
        raise CheckpointError(f"{parsed}: hub model {parsed.repo_id} has none of the files moetier reads "
                              "(config.json, *.safetensors); a GGUF repository needs a selector, e.g. "
                              f"{parsed.repo_id}:Q4_K_M")  # fmt: skip
    snapshot = _snapshot_dir(cache, parsed.repo_id, commit)
    if any(not (snapshot / f).is_file() for f in files):
        log(download_plan(parsed, files, sizes, snapshot))
    folder = Path(snapshot_download(
        parsed.repo_id, revision=parsed.revision, cache_dir=cache, allow_patterns=files,
        tqdm_class=None if progress else _SilentTqdm,
    ))  # fmt: skip
    if parsed.selector is None:
        _check_checkpoint(folder, str(parsed), "the repository does not hold a safetensors checkpoint")
        return folder
    return folder / files[0]


__all__ = [
    "CHECKPOINT_FILES",
    "CHECKPOINT_GLOBS",
    "SPEC_FORM",
    "HubSpec",
    "checkpoint_files",
    "download_plan",
    "gguf_files",
    "hub_spec",
    "parse_hub_spec",
    "resolve_model",
    "select_files",
]
