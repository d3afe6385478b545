"""models/hub.py: MODEL as a Hugging Face hub id, resolved offline against a cache laid out as huggingface_hub
lays it out (tests/hub_cache.py); the network part (HfApi.model_info, the download) is replaced by fakes."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest
from huggingface_hub.errors import OfflineModeIsEnabled

from hub_cache import put_in_cache
from moetier.errors import CheckpointError, ConfigError
from moetier.models import hub
from moetier.models.hub import HubSpec, checkpoint_files, gguf_files, parse_hub_spec, resolve_model

REPO = "acme/tiny-moe"
C1, C2 = "1" * 40, "2" * 40
INDEX_NAME = "model.safetensors.index.json"
CONFIG = json.dumps({"model_type": "qwen3_moe"}).encode()
INDEX = json.dumps({"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors",
                                                   "b": "model-00002-of-00002.safetensors"}}).encode()  # fmt: skip
CHECKPOINT = {
    "config.json": CONFIG, "tokenizer.json": b"{}", INDEX_NAME: INDEX,
    "model-00001-of-00002.safetensors": b"shard 1", "model-00002-of-00002.safetensors": b"shard 2",
}  # fmt: skip
GGUF_REPO = "acme/tiny-moe-GGUF"
GGUF = {
    "tiny-moe-Q4_K_M.gguf": b"q4km", "tiny-moe-Q4_K_S.gguf": b"q4ks", "tiny-moe-IQ4_XS.gguf": b"iq4",
    "mmproj-Q4_K_M.gguf": b"projector", "README.md": b"readme",
    "Q8_0/tiny-moe-Q8_0-00001-of-00003.gguf": b"s1", "Q8_0/tiny-moe-Q8_0-00002-of-00003.gguf": b"s2",
    "Q8_0/tiny-moe-Q8_0-00003-of-00003.gguf": b"s3",
}  # fmt: skip


def _same(a: Path, b: Path) -> bool:
    return a.resolve() == b.resolve()


# -- the spec ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Qwen/Qwen3-30B-A3B", HubSpec("Qwen/Qwen3-30B-A3B")),
        ("Qwen/Qwen3-30B-A3B@v1.0", HubSpec("Qwen/Qwen3-30B-A3B", "v1.0")),
        ("unsloth/Qwen3-30B-A3B-GGUF:Q4_K_M", HubSpec("unsloth/Qwen3-30B-A3B-GGUF", None, "Q4_K_M")),
        ("o/n@refs/pr/1:x.gguf", HubSpec("o/n", "refs/pr/1", "x.gguf")),
        ("no-slash", None), ("a/b/c", None), ("/abs/path", None), ("./rel/x", None), ("o--x/n", None),
        ("o/n.git", None), ("o/n@", None), ("o/n:", None), ("o/ n", None),
    ],
)  # fmt: skip
def test_parse_hub_spec(text: str, expected: HubSpec | None) -> None:
    assert parse_hub_spec(text) == expected
    if expected is not None:
        assert str(expected) == text


@pytest.mark.parametrize("spec", ["no-such-folder", "a/b/c", "/nowhere/at/all", "owner/name:"])
def test_neither_path_nor_hub_id(spec: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="neither an existing path nor a Hugging Face hub id"):
        resolve_model(spec, cache_dir=tmp_path, offline=True)


def test_an_existing_path_wins_over_an_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    put_in_cache(tmp_path / "cache", REPO, CHECKPOINT, C1)  # the id is cached too: the folder still wins
    monkeypatch.chdir(tmp_path)
    (tmp_path / REPO).mkdir(parents=True)
    got = resolve_model(REPO, cache_dir=tmp_path / "cache", offline=False)  # no network is asked either
    assert got == Path(REPO) and _same(got, tmp_path / REPO)
    one = tmp_path / "model.gguf"
    one.write_bytes(b"x")
    assert resolve_model(str(one), offline=True) == one  # a file too


# -- offline: the cache ----------------------------------------------------------------------
def test_hub_id_resolves_to_its_cached_snapshot(tmp_path: Path) -> None:
    snap = put_in_cache(tmp_path, REPO, CHECKPOINT, C1)
    got = resolve_model(REPO, cache_dir=tmp_path, offline=True)
    assert _same(got, snap) and got.name == C1
    assert (got / "config.json").is_symlink() and (got / "config.json").read_bytes() == CONFIG


def test_revision_branch_tag_and_commit(tmp_path: Path) -> None:
    put_in_cache(tmp_path, REPO, CHECKPOINT, C1, ref="main")
    put_in_cache(tmp_path, REPO, CHECKPOINT | {"config.json": b'{"v": 2}'}, C2, ref="v2")
    assert resolve_model(REPO, cache_dir=tmp_path, offline=True).name == C1
    assert resolve_model(f"{REPO}@main", cache_dir=tmp_path, offline=True).name == C1
    v2 = resolve_model(f"{REPO}@v2", cache_dir=tmp_path, offline=True)
    assert v2.name == C2 and (v2 / "config.json").read_bytes() == b'{"v": 2}'
    assert resolve_model(f"{REPO}@{C2}", cache_dir=tmp_path, offline=True).name == C2
    with pytest.raises(CheckpointError, match=r"acme/tiny-moe.*revision nope.*not in the Hugging Face cache"):
        resolve_model(f"{REPO}@nope", cache_dir=tmp_path, offline=True)


def test_not_cached_offline_names_the_repo_and_the_cache(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError) as err:
        resolve_model("acme/absent", cache_dir=tmp_path, offline=True)
    msg = str(err.value)
    assert "acme/absent" in msg and str(tmp_path) in msg and "HF_HUB_OFFLINE" in msg and "hf download" in msg


def test_missing_shard_offline_is_named(tmp_path: Path) -> None:
    partial = {k: v for k, v in CHECKPOINT.items() if k != "model-00002-of-00002.safetensors"}
    put_in_cache(tmp_path, REPO, partial, C1)
    with pytest.raises(CheckpointError, match=r"acme/tiny-moe.*lacks model-00002-of-00002\.safetensors"):
        resolve_model(REPO, cache_dir=tmp_path, offline=True)


def test_missing_blob_offline_is_named(tmp_path: Path) -> None:
    snap = put_in_cache(tmp_path, REPO, CHECKPOINT, C1)
    (snap / "config.json").resolve().unlink()  # the link dangles, as after a deleted blob
    with pytest.raises(CheckpointError, match=r"acme/tiny-moe.*lacks config\.json"):
        resolve_model(REPO, cache_dir=tmp_path, offline=True)


def test_hub_offline_constant_is_the_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    put_in_cache(tmp_path, REPO, CHECKPOINT, C1)
    monkeypatch.setattr(hub.hub_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub, "HfApi", None)  # any network call would fail
    assert resolve_model(REPO, cache_dir=tmp_path).name == C1


# -- GGUF selectors --------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("selector", "expected"),
    [
        ("Q4_K_M", "tiny-moe-Q4_K_M.gguf"),  # not mmproj-Q4_K_M.gguf, a projector
        ("q4_k_m", "tiny-moe-Q4_K_M.gguf"),  # case-insensitive
        ("IQ4_XS", "tiny-moe-IQ4_XS.gguf"),
        ("Q8_0", "Q8_0/tiny-moe-Q8_0-00001-of-00003.gguf"),  # shards: the first
        ("tiny-moe-Q4_K_S.gguf", "tiny-moe-Q4_K_S.gguf"),  # an exact file
        ("tiny-moe-Q8_0-00002-of-00003.gguf", "Q8_0/tiny-moe-Q8_0-00001-of-00003.gguf"),  # a shard: its set
    ],
)
def test_gguf_selector_offline(selector: str, expected: str, tmp_path: Path) -> None:
    snap = put_in_cache(tmp_path, GGUF_REPO, GGUF, C1)
    got = resolve_model(f"{GGUF_REPO}:{selector}", cache_dir=tmp_path, offline=True)
    assert _same(got, snap / expected) and got.is_file()


def test_gguf_shards_go_together() -> None:
    shards = [f"Q8_0/tiny-moe-Q8_0-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    assert gguf_files(GGUF, "Q8_0", "here") == shards
    assert gguf_files(GGUF, "tiny-moe-Q8_0-00003-of-00003.gguf", "here") == shards


@pytest.mark.parametrize(
    ("selector", "error", "needles"),
    [
        ("Q4_K", ConfigError, ["more than one", "tiny-moe-Q4_K_M.gguf", "tiny-moe-Q4_K_S.gguf"]),
        ("Q2_K", ConfigError, ["no GGUF file matches 'Q2_K'", "tiny-moe-Q4_K_M.gguf"]),
        ("other.gguf", ConfigError, ["no GGUF file matches 'other.gguf'"]),
    ],
)
def test_gguf_selector_errors(selector: str, error: type[Exception], needles: list[str]) -> None:
    with pytest.raises(error) as err:
        gguf_files(GGUF, selector, GGUF_REPO)
    assert all(n in str(err.value) for n in needles), str(err.value)


def test_gguf_missing_shard_offline_is_named(tmp_path: Path) -> None:
    put_in_cache(tmp_path, GGUF_REPO, {k: v for k, v in GGUF.items() if "00002-of" not in k}, C1)
    with pytest.raises(CheckpointError, match=r"acme/tiny-moe-GGUF:Q8_0.*missing: Q8_0/tiny-moe-Q8_0-00002-of-00003"):
        resolve_model(f"{GGUF_REPO}:Q8_0", cache_dir=tmp_path, offline=True)


# -- online, the network faked ---------------------------------------------------------------
REMOTE = {  # repository path -> size: what model_info(files_metadata=True) lists
    "config.json": 100, "tokenizer.json": 2_000, "tokenizer_config.json": 300, "README.md": 5_000,
    INDEX_NAME: 400, "model-00001-of-00002.safetensors": 2 * 2**30, "model-00002-of-00002.safetensors": 2**30,
    "consolidated.safetensors": 3 * 2**30, "original/model.safetensors": 3 * 2**30, "tokenizer.model": 50,
}  # fmt: skip


class FakeApi:
    """HfApi.model_info from a table (or an error); counts the calls."""

    calls: ClassVar[list[tuple[str, str | None]]] = []
    error: ClassVar[Exception | None] = None
    listing: ClassVar[dict[str, int]] = REMOTE

    def model_info(self, repo_id: str, *, revision: str | None = None, files_metadata: bool = False) -> Any:
        assert files_metadata
        FakeApi.calls.append((repo_id, revision))
        if FakeApi.error is not None:
            raise FakeApi.error
        siblings = [SimpleNamespace(rfilename=k, size=v) for k, v in FakeApi.listing.items()]
        return SimpleNamespace(sha=C1, siblings=siblings)


@pytest.fixture
def online(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Fakes the hub: model_info from REMOTE, a download that writes the asked files into the cache."""
    seen: dict[str, Any] = {}
    FakeApi.calls, FakeApi.error, FakeApi.listing = [], None, REMOTE

    def download(repo_id: str, **kwargs: Any) -> str:
        if kwargs.get("local_files_only"):
            return str(hub_snapshot_download(repo_id, **kwargs))
        seen.update(kwargs, repo_id=repo_id)
        files = {f: (CHECKPOINT | GGUF).get(f, b"x") for f in kwargs["allow_patterns"]}
        return str(put_in_cache(Path(kwargs["cache_dir"]), repo_id, files, C1, kwargs["revision"] or "main"))

    hub_snapshot_download = hub.snapshot_download
    monkeypatch.setattr(hub, "HfApi", FakeApi)
    monkeypatch.setattr(hub, "snapshot_download", download)
    return seen


def test_checkpoint_files_are_only_what_moetier_reads() -> None:
    assert checkpoint_files(REMOTE) == sorted([
        "config.json", "tokenizer.json", "tokenizer_config.json", INDEX_NAME, "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors", "tokenizer.model",
    ])  # fmt: skip
    assert checkpoint_files(["config.json", "consolidated.safetensors"]) == ["config.json", "consolidated.safetensors"]


def test_online_download_says_its_size_first(online: dict[str, Any], tmp_path: Path) -> None:
    put_in_cache(tmp_path, REPO, {"config.json": CONFIG}, C1)  # one file already cached
    lines: list[str] = []
    got = resolve_model(f"{REPO}@main", cache_dir=tmp_path, offline=False, progress=False, log=lines.append)
    assert got.name == C1 and (got / "model-00002-of-00002.safetensors").read_bytes() == b"shard 2"
    assert FakeApi.calls == [(REPO, "main")]
    assert online["revision"] == "main" and online["tqdm_class"] is not None  # progress=False: a silent bar
    assert sorted(online["allow_patterns"]) == checkpoint_files(REMOTE)
    size = 3 * 2**30 + 2_000 + 300 + 400 + 50  # everything selected but the cached config.json
    assert lines == [f"{REPO}@main: downloading {hub.format_size(size)} (6 of 7 files; 1 already cached) into "
                     f"{tmp_path}"]  # fmt: skip
    assert "3.00 GiB" in lines[0]


def test_online_everything_cached_downloads_nothing_new(online: dict[str, Any], tmp_path: Path) -> None:
    put_in_cache(tmp_path, REPO, {f: CHECKPOINT.get(f, b"x") for f in checkpoint_files(REMOTE)}, C1)
    lines: list[str] = []
    assert resolve_model(REPO, cache_dir=tmp_path, offline=False, log=lines.append).name == C1
    assert lines == [] and online["tqdm_class"] is None  # progress=True: huggingface_hub's own bar


def test_online_gguf_downloads_only_the_selected_shards(online: dict[str, Any], tmp_path: Path) -> None:
    FakeApi.listing = {k: len(v) for k, v in GGUF.items()}
    lines: list[str] = []
    got = resolve_model(f"{GGUF_REPO}:Q8_0", cache_dir=tmp_path, offline=False, log=lines.append)
    assert got.name == "tiny-moe-Q8_0-00001-of-00003.gguf" and got.is_file()
    assert online["allow_patterns"] == [f"Q8_0/tiny-moe-Q8_0-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    assert lines == [f"{GGUF_REPO}:Q8_0: downloading 6 B (3 of 3 files) into {tmp_path}"]


class NetworkError(Exception):
    """Stands for httpx's connection errors, which are not OSErrors."""


class ConnectError(NetworkError):
    pass


@pytest.mark.parametrize("error", [OSError("Network is unreachable"), ConnectError("Network is unreachable")])
def test_unreachable_hub_falls_back_to_the_cache(error: Exception, online: dict[str, Any], tmp_path: Path) -> None:
    put_in_cache(tmp_path, REPO, CHECKPOINT, C1)
    FakeApi.error = error
    lines: list[str] = []
    assert resolve_model(REPO, cache_dir=tmp_path, offline=False, log=lines.append).name == C1
    name = type(error).__name__
    assert lines == [f"{REPO}: the hub is unreachable: {name}: Network is unreachable; reading the cache"]
    assert "repo_id" not in online  # nothing downloaded
    FakeApi.error = ValueError("a bug, not the network")
    with pytest.raises(ValueError, match="a bug"):
        resolve_model(REPO, cache_dir=tmp_path, offline=False)
    FakeApi.error = OfflineModeIsEnabled("offline")
    with pytest.raises(CheckpointError, match=r"acme/absent.*not in the Hugging Face cache.*HF_HUB_OFFLINE is set"):
        resolve_model("acme/absent", cache_dir=tmp_path, offline=False)
