"""`ServeConfig`: everything `moetier serve` needs besides the engine, frozen and composed by section.

ServeConfig = BatchConfig (runtime/batch.py: batch size, attention, KV budget, batch invariance)
+ WorkerLimits (serve/worker.py: queue length, queue wait and request time limits) + the HTTP
layer's own fields (served model id, API key, body limit, body read timeout). The CLI builds one in
one place (cli/serve.py) and create_app / any other host (a Ray Serve replica) takes it whole.

Invariants: values are checked on construction (ConfigError naming the field); `api_key` is never
empty (None means no key) and is left out of the repr, so logging a config never prints it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from moetier.errors import ConfigError
from moetier.runtime.batch import BatchConfig
from moetier.serve.worker import WorkerLimits

MAX_BODY_BYTES = 8 << 20  # default request body limit (413 past it)
READ_TIMEOUT_S = 30.0  # default time a client has to send the whole body (408 past it)
API_KEY_ENV = "MOETIER_API_KEY"  # the environment variable `moetier serve` reads the key from


@dataclass(frozen=True)
class ServeConfig:
    model_name: str | None = None  # the id clients send; None: the checkpoint folder's name
    batch: BatchConfig = field(default_factory=BatchConfig)
    limits: WorkerLimits = field(default_factory=WorkerLimits)
    api_key: str | None = field(default=None, repr=False)  # None: no key; else `Authorization: Bearer <key>`
    max_body_bytes: int = MAX_BODY_BYTES
    read_timeout_s: float = READ_TIMEOUT_S  # the whole body must arrive within this long of the request head

    def __post_init__(self) -> None:
        if self.model_name is not None and not self.model_name.strip():
            raise ConfigError("model_name must not be empty (None: the checkpoint folder's name)")
        if self.api_key is not None and (not self.api_key or self.api_key != self.api_key.strip()):
            raise ConfigError("api_key must be a non-empty string without surrounding whitespace (None: no key)")
        if self.max_body_bytes < 1:
            raise ConfigError(f"max_body_bytes must be at least 1, got {self.max_body_bytes}")
        if not (math.isfinite(self.read_timeout_s) and self.read_timeout_s > 0):
            raise ConfigError(f"read_timeout_s must be a positive number of seconds, got {self.read_timeout_s}")


__all__ = ["API_KEY_ENV", "MAX_BODY_BYTES", "READ_TIMEOUT_S", "ServeConfig"]
