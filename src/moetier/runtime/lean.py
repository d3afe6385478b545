"""The engine's own decoder for llama-style attention families (work in progress)."""

from __future__ import annotations

from moetier.runtime.loader import LoadedModel


def lean_supported(loaded: LoadedModel) -> bool:
    return False


class LeanDecoder:  # replaced by the real implementation in this same change
    def __init__(self, loaded: LoadedModel, max_seq_len: int) -> None:
        raise NotImplementedError
