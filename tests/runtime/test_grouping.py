"""Grouping a call's routing by expert (runtime/executors/base.py group_by_expert)."""

from __future__ import annotations

import torch

from moetier.runtime.executors.base import group_by_expert


def test_an_expert_chosen_twice_by_one_token_counts_both_weights():
    """Hash routing (DeepSeek-V4's first layers) can give one token the same expert in two top-k slots; the
    reference then adds that expert's output twice. Decode (one token) and prefill must agree."""
    ids = torch.tensor([[3, 3, 1]])
    weights = torch.tensor([[0.5, 0.25, 0.125]])
    decode = group_by_expert(ids, weights, num_experts=4)
    assert decode.counts == {3: 1, 1: 1}
    assert decode.data == {3: 0.75, 1: 0.125}
    prefill = group_by_expert(ids.repeat(2, 1), weights.repeat(2, 1), num_experts=4)
    tok, w = prefill.data[3]
    per_token = torch.zeros(2).index_add_(0, tok, w)
    assert per_token.tolist() == [0.75, 0.75]
