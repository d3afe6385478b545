"""The MODEL argument of the engine's commands (generate, eval, serve, info, quantize, calibrate): a local
checkpoint folder or file, or a Hugging Face hub id, turned into a local path in one place (`open_model`).

A hub id (`owner/name[@revision][:QUANT|:FILE.gguf]`, models.hub) is fetched into huggingface_hub's own cache,
with its progress bar and a download-size line on stderr; offline (HF_HUB_OFFLINE=1, or no network) the cache
is read. Its snapshot is read-only (links into the cache's blobs), so what moetier writes for a hub model goes to
a folder of its own, WORK = CACHE/hub/<owner>--<name> (`--<file stem>` added for a GGUF selector; CACHE is
--kernel-cache, else $MOETIER_CACHE, else ~/.cache/moetier): the quantized tiers under WORK/moetier-quant and the
sparsity table at WORK/moetier-sparsity/thresholds.json, the layout a local folder has. For a local MODEL,
WORK is MODEL itself and the defaults are unchanged.

Invariants:
- an existing path always wins over an id-shaped name; a spec that is neither is a ConfigError (one line,
  exit 2, through console.user_errors);
- the hub is reached only while MODEL is resolved, and only when the user did not set HF_HUB_OFFLINE; right
  after, app.offline_by_default makes the rest of the command (transformers reading the local snapshot) offline
  unless the user chose otherwise;
- an explicit --quant-dir / --sparsity-table / --out always wins over WORK.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace
from pathlib import Path

from rich.console import Console

from moetier.cli.app import offline_by_default
from moetier.config import EngineConfig
from moetier.formats.qtier import TIER_ROOT
from moetier.kernels.sparse import default_table_path
from moetier.models.hub import HubSpec, hub_spec, resolve_model


def moetier_cache(root: Path | None = None) -> Path:
    """moetier's cache folder: `root` (--kernel-cache), else $MOETIER_CACHE, else ~/.cache/moetier
    (kernels.native.cache_root's default)."""
    if root is not None:
        return root.expanduser()
    env = os.environ.get("MOETIER_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "moetier"


@dataclass(frozen=True)
class ModelArg:
    """MODEL resolved: `path` is the local checkpoint folder or .gguf file; `hub` the id it came from (None for a
    local path); `work` the folder whose moetier-quant / moetier-sparsity hold what moetier writes for it."""

    spec: str
    path: Path
    hub: HubSpec | None
    work: Path

    @property
    def label(self) -> str:
        """How reports name the model: the hub id as typed, else the path."""
        return str(self.hub) if self.hub is not None else str(self.path)

    @property
    def quant_root(self) -> Path | None:
        """Default tier root: WORK/moetier-quant for a hub model; None (MODEL/moetier-quant) for a local one."""
        return self.work / TIER_ROOT if self.hub is not None else None

    @property
    def sparsity_table(self) -> Path:
        """Default sparsity table: WORK/moetier-sparsity/thresholds.json."""
        return default_table_path(self.work)

    def defaults(self, config: EngineConfig) -> EngineConfig:
        """`config` with the hub model's tier root and sparsity table where the flags left them out."""
        if self.hub is None:
            return config
        precision, sparsity = config.precision, config.sparsity
        if precision.quant_dir is None:
            precision = replace(precision, quant_dir=str(self.quant_root))
        if sparsity.table is None:
            sparsity = replace(sparsity, table=str(self.sparsity_table))
        return replace(config, precision=precision, sparsity=sparsity)


def open_model(spec: str, err: Console, cache: Path | None = None) -> ModelArg:
    """Resolve MODEL (models.hub.resolve_model: the hub's progress bar and the download-size line on `err`),
    then make the rest of the process offline unless the user chose (app.offline_by_default)."""
    hub = hub_spec(spec)
    path = resolve_model(spec, log=lambda line: err.print(line, markup=False, highlight=False, soft_wrap=True))
    offline_by_default()
    if hub is None:
        return ModelArg(spec, path, None, path)
    gguf = re.sub(r"-\d{5}-of-\d{5}$", "", path.name.removesuffix(".gguf"))  # a split file's stem
    name = hub.slug + (f"--{gguf}" if path.is_file() else "")
    return ModelArg(spec, path, hub, moetier_cache(cache) / "hub" / name)


__all__ = ["ModelArg", "moetier_cache", "open_model"]
