"""The executor variants by name: the plain dict runtime/wire.py chooses from.

Invariant: a name here is an ExecutorSpec whose `name` is that name; a new variant is one new file in
this package and one entry here.
"""

from __future__ import annotations

from moetier.runtime.executors import dense, hybrid, native, sparse
from moetier.runtime.executors.spec import ExecutorSpec

EXECUTORS: dict[str, ExecutorSpec] = {spec.name: spec for spec in (dense.SPEC, native.SPEC, sparse.SPEC, hybrid.SPEC)}
