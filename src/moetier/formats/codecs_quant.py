"""Codecs of quantised safetensors checkpoints: FP8 block-scaled, MXFP4, GPTQ / AWQ int4, compressed-tensors."""

from __future__ import annotations

from moetier.formats.encoded import Codec

QUANT_CODECS: dict[str, Codec] = {}
