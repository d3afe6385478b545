"""--cache-policy auto (the default): lru for one sequence; `serve` resolves it by --max-batch (cli/serve.py)."""

from __future__ import annotations

from moetier.cli.engine_flags import EngineFlags


def test_auto_is_the_default_and_means_lru_for_one_sequence() -> None:
    assert EngineFlags().cache_policy == "auto"
    assert EngineFlags().config().cache.policy == "lru"
    assert EngineFlags(cache_policy="mrs-admit").config().cache.policy == "mrs-admit"
