"""Batch-invariant greedy decoding (BatchConfig.batch_invariant, runtime/batch.py): in bf16 a prompt's
tokens in a batch are exactly its tokens alone. Ordinary batched decoding can differ there: a matmul's
kernel and reduction order depend on its row count (kernels.matmul picks per call; an expert's token group
changes with the batch), which moves bf16 rounding and, at a near tie, the greedy token. The invariant mode
decodes every row as its own one-row forward, the path a sequence alone takes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import moetier
from moetier import EngineConfig, RuntimeConfig
from moetier.errors import ExpertReadError
from moetier.runtime.batch import BatchConfig, BatchRunner, SeqRequest
from moetier.runtime.lean import LeanDecoder
from moetier.types import ExpertKey

MODEL = Path(__file__).resolve().parents[2] / "models" / "tiny-shakespeare-moe"
NEVER: frozenset[int] = frozenset()
N = 12


def _prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 4000, (int(torch.randint(2, 20, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]  # fmt: skip


def _run(engine: moetier.Engine, prompts: list[list[int]], config: BatchConfig) -> list[list[int]]:
    runner = BatchRunner(engine, config)
    ids = [runner.add(SeqRequest(p, N, stop_ids=NEVER)) for p in prompts]
    out: dict[int, list[int]] = {i: [] for i in ids}
    while not runner.idle():
        for ev in runner.step():
            if ev.token is not None:
                out[ev.seq_id].append(ev.token)
    return [out[i] for i in ids]


def test_bf16_batch_equals_alone() -> None:
    """torch kernels (native off), where on this project's CPU prompt 4 of these 8 comes out differently in an
    ordinary batch of them (native kernels: none here; other CPUs differ elsewhere)."""
    runtime = RuntimeConfig(device="cpu", dtype="bf16", native_kernels=False)
    engine = moetier.load(MODEL, EngineConfig(runtime=runtime))
    try:
        prompts = _prompts(16)[8:]
        alone = [engine.generate(p, N, stop_at_eos=False).token_ids for p in prompts]
        assert _run(engine, prompts[4:5], BatchConfig(max_batch=1)) == alone[4:5]  # alone through the runner too
        assert _run(engine, prompts, BatchConfig(max_batch=8, batch_invariant=True)) == alone
    finally:
        engine.close()


def test_invariant_mode_fails_only_the_faulty_row(monkeypatch: pytest.MonkeyPatch) -> None:
    # the fault is injected into the torch path's layers (finish_layer), so the native step is off; the native
    # step's own faults: tests/runtime/test_native_step.py
    runtime = RuntimeConfig(device="cpu", dtype="bf16", native_step=False)
    engine = moetier.load(MODEL, EngineConfig(runtime=runtime))
    try:
        prompts = _prompts(4)
        alone = [engine.generate(p, N, stop_at_eos=False).token_ids for p in prompts]
        lean = engine.decoder
        assert isinstance(lean, LeanDecoder)
        orig, calls = lean.finish_layer, []

        def finish_layer(L: object, x: torch.Tensor, att: torch.Tensor) -> torch.Tensor:
            calls.append(x.shape[0])
            # step 4 (the 3 before it ran 4 rows each), row 2, its first layer
            if len(calls) == 3 * len(lean.layers) * 4 + 2 * len(lean.layers) + 1:
                raise ExpertReadError("x.safetensors: EIO", ExpertKey(1, 0), "x.safetensors", (0,))
            return orig(L, x, att)  # type: ignore[arg-type]

        monkeypatch.setattr(lean, "finish_layer", finish_layer)
        got = _run(engine, prompts, BatchConfig(max_batch=4, batch_invariant=True))
        assert all(c == 1 for c in calls[4 * len(lean.layers):])  # decode rows one at a time
        assert [g for i, g in enumerate(got) if i != 2] == [a for i, a in enumerate(alone) if i != 2]
        assert got[2] == alone[2][: len(got[2])] and len(got[2]) < N
    finally:
        engine.close()
