"""Codecs of GGUF block types (Q8_0, Q4_0, Q4_K, Q5_K, Q6_K, ...), decoded with torch."""

from __future__ import annotations

from moetier.formats.encoded import Codec

GGUF_CODECS: dict[str, Codec] = {}
