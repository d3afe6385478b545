"""The codec registry: codec name (an encoded TensorLocation's dtype) -> Codec (formats/encoded.py)."""

from __future__ import annotations

from moetier.formats.codecs_gguf import GGUF_CODECS
from moetier.formats.codecs_quant import QUANT_CODECS
from moetier.formats.encoded import Codec

CODECS: dict[str, Codec] = {**QUANT_CODECS, **GGUF_CODECS}
