"""Cost model: a HardwareProfile (data in moetier/data/profiles/) and a ModelSpec turned into per-domain time functions.

Torch-free; the engine, the schedulers and the simulator price work with the same functions.

Expert compute time of `n` tokens on a domain ("gpu" | "cpu"):
- the ComputeProfile has a LUT for the precision: piecewise-linear interpolation in tokens
  (linear extrapolation beyond the last point and below the first, never below 0), scaled by
  the ratio of expert params (target H*I over the LUT's lut_shape H*I). When it also has a
  `small_luts` entry measured on a second, small shape (`small_shape`), time is linear in params
  through the two measured shapes instead: t(n, P) = small(n) + (lut(n) - small(n)) *
  (P - P_small) / (P_ref - P_small), which keeps the fixed per-call cost that plain scaling
  would shrink with the expert (it matters for small experts: 2x on the bundled model);
- else a roofline: max(weight bytes / mem_bw, 2*3*H*I*n / (peak_flops * eff(n))) + overhead_s,
  where eff(n) is the profile's `efficiency` curve ((tokens, fraction of peak) points, piecewise
  linear, flat beyond the ends; empty = 1.0). It models GPUs whose matmul utilisation rises
  slowly with tokens per expert (TriMoE: about 30% at 256 tokens on an H100).
Routed experts add the domain's `dispatch_s`, the runtime's own bookkeeping per expert call.
Move time over a link ("pcie" | "disk"): latency_s + bytes / bandwidth.
Dense time of one decoder layer (`dense_s`): a roofline over the non-expert weights read at
dense_bw (attention, norms, router; the dense MLP when moe=False) plus the KV cache read once
(context x kv bytes per token), against 2 x params x tokens + attention score FLOPs; plus
layer_overhead_s.
Head time of one decode step (`head_s`): the LM head (vocab x hidden weights) and final norm for the
step's new tokens (one per sequence) on the same roofline, plus token_overhead_s, the engine's fixed
cost per forward (embedding lookup, sampling, its Python loop).

The profiles themselves (dataclasses, checks, JSON files) are policies/hwprofile.py's, re-exported here.

Invariants: every time is >= 0 and finite; zero tokens / zero bytes cost 0; more tokens never
cost less on the roofline; profiles round-trip through save_profile/load_profile unchanged.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from itertools import chain

from moetier.errors import ConfigError
from moetier.policies.hwprofile import (  # the profile half, re-exported: callers import it from here
    PRECISIONS,
    PROFILES_DIR,
    ComputeProfile,
    HardwareProfile,
    LinkProfile,
    interp,
    load_profile,
    profile_from_dict,
    profile_names,
    profile_to_dict,
    save_profile,
    shape_params,
)
from moetier.policies.schedule_base import ExpertWork
from moetier.specs import ModelSpec
from moetier.types import ExpertKey


# The cost model ------------------------------------------------------------------------------------------------
class CostModel:
    """Per-domain time functions of one model on one machine. Domains: "gpu" | "cpu"; links: "pcie" | "disk"."""

    def __init__(self, profile: HardwareProfile, spec: ModelSpec, precision: str = "full") -> None:
        if precision not in PRECISIONS:
            raise ConfigError(f"unknown precision {precision!r}; expected one of {', '.join(PRECISIONS)}")
        self.profile, self.spec, self.precision = profile, spec, precision
        self.expert_nbytes = spec.expert_bytes(precision)
        self.shared_nbytes = spec.shared_bytes("full")

    def _domain(self, domain: str) -> ComputeProfile:
        if domain == "cpu":
            return self.profile.cpu
        if domain == "gpu":
            if self.profile.gpu is None:
                raise ConfigError(f"profile {self.profile.name!r} has no GPU; use domain 'cpu'")
            return self.profile.gpu
        raise ConfigError(f"unknown compute domain {domain!r}; expected 'gpu' or 'cpu'")

    def _link(self, link: str) -> LinkProfile:
        if link == "disk":
            return self.profile.disk
        if link == "pcie":
            if self.profile.pcie is None:
                raise ConfigError(f"profile {self.profile.name!r} has no PCIe link (no GPU); use link 'disk'")
            return self.profile.pcie
        raise ConfigError(f"unknown link {link!r}; expected 'pcie' or 'disk'")

    def ffn_s(self, domain: str, tokens: int, inter: int, precision: str, nbytes: int) -> float:
        """One SwiGLU MLP of intermediate size `inter` (hidden = the spec's) over `tokens` tokens."""
        if tokens <= 0:
            return 0.0
        c = self._domain(domain)
        lut = c.luts.get(precision)
        if lut and c.lut_shape:
            params, ref = self.spec.hidden * inter, shape_params(c.lut_shape)
            y_ref = interp(lut, tokens, extrapolate=True)
            small = c.small_luts.get(precision)
            if small and c.small_shape:
                y_small, p_small = interp(small, tokens, extrapolate=True), shape_params(c.small_shape)
                return max(0.0, y_small + (y_ref - y_small) * (params - p_small) / (ref - p_small))
            return y_ref * params / ref
        flops = 2 * 3 * self.spec.hidden * inter * tokens
        return max(nbytes / c.mem_bw, flops / (c.peak_flops * c.eff(tokens))) + c.overhead_s

    def expert_s(self, domain: str, tokens: int, shared: bool = False) -> float:
        """Compute time of one routed (or shared, always full precision) expert with `tokens` tokens."""
        if shared:
            if not self.spec.num_shared:
                raise ConfigError(f"spec {self.spec.name!r} has no shared experts")
            return self.ffn_s(domain, tokens, self.spec.shared_inter, "full", self.shared_nbytes)
        dispatch = self._domain(domain).dispatch_s if tokens > 0 else 0.0
        return self.ffn_s(domain, tokens, self.spec.moe_inter, self.precision, self.expert_nbytes) + dispatch

    def move_s(self, link: str, nbytes: int) -> float:
        """Time to move `nbytes` over the link (0 for nothing)."""
        if nbytes <= 0:
            return 0.0
        lk = self._link(link)
        return lk.latency_s + nbytes / lk.bandwidth

    def dense_s(self, domain: str, tokens: int, context: int, moe: bool = True) -> float:
        """One decoder layer's non-expert work for `tokens` new tokens of ONE sequence at KV length `context`
        (the KV cache is read once per call; a batch of independent sequences is one call per sequence)."""
        if tokens <= 0:
            return 0.0
        c, s = self._domain(domain), self.spec
        if not moe and s.dense_inter == 0:
            raise ConfigError(f"spec {s.name!r} has no dense (non-MoE) layers; dense_s(moe=False) has no MLP to price")
        params = s.layer_dense_params(moe)
        nbytes = params * s.dtype_bytes + max(0, context) * s.kv_bytes_per_token()
        flops = 2 * params * tokens + s.attention_flops(tokens, max(0, context))
        bw = c.dense_bw or c.mem_bw
        return max(nbytes / bw, flops / (c.peak_flops * c.eff(tokens))) + c.layer_overhead_s

    def head_s(self, domain: str, tokens: int = 1) -> float:
        """One forward's LM head (logits of `tokens` positions) plus the domain's fixed per-forward cost."""
        if tokens <= 0:
            return 0.0
        c, s = self._domain(domain), self.spec
        params = s.vocab * s.hidden
        return max(params * s.dtype_bytes / (c.dense_bw or c.mem_bw), 2 * params * tokens / c.peak_flops) + (
            c.token_overhead_s
        )

    def work(
        self,
        layer: int,
        token_counts: Mapping[int, int],
        cached: Collection[ExpertKey],
        fast: str = "gpu",
        slow: str | None = "cpu",
        link: str = "pcie",
        shared_tokens: int = 0,
    ) -> list[ExpertWork]:
        """Price one layer call: routed experts (id -> tokens, ids ascending; zero-token entries skipped) and,
        when shared_tokens > 0, the spec's shared experts (ids -1, -2, ..., cached=True)."""
        self._domain(fast)
        if slow is not None:
            self._domain(slow)
        move_routed = self.move_s(link, self.expert_nbytes)
        out: list[ExpertWork] = []
        for e in sorted(token_counts):
            n = int(token_counts[e])
            if n < 0 or not 0 <= e < self.spec.num_experts:
                raise ConfigError(
                    f"work: expert {e} with {n} tokens is outside the spec "
                    f"({self.spec.num_experts} experts, tokens >= 0)"
                )
            if n == 0:
                continue
            key = ExpertKey(layer, e)
            out.append(ExpertWork(
                key=key, tokens=n, cached=key in cached, fast_s=self.expert_s(fast, n),
                slow_s=None if slow is None else self.expert_s(slow, n), move_s=move_routed,
                nbytes=self.expert_nbytes,
            ))  # fmt: skip
        if shared_tokens > 0:
            move_shared = self.move_s(link, self.shared_nbytes)
            for j in range(self.spec.num_shared):
                out.append(ExpertWork(
                    key=ExpertKey(layer, -(j + 1)), tokens=shared_tokens, cached=True,
                    fast_s=self.expert_s(fast, shared_tokens, shared=True),
                    slow_s=None if slow is None else self.expert_s(slow, shared_tokens, shared=True),
                    move_s=move_shared, nbytes=self.shared_nbytes,
                ))  # fmt: skip
        return out


def token_counts(ids: Sequence[Sequence[int]]) -> dict[int, int]:
    """Tokens per expert of one layer call from its top-k ids [T][k], in order of first appearance (-1, a pair a
    routing override skipped, is no expert)."""
    counts = Counter(map(int, chain.from_iterable(ids)))  # counted in C: the prefetcher calls it per MoE call
    counts.pop(-1, None)
    return dict(counts)


__all__ = [
    "PRECISIONS", "PROFILES_DIR", "ComputeProfile", "CostModel", "HardwareProfile", "LinkProfile", "load_profile",
    "profile_from_dict", "profile_names", "profile_to_dict", "save_profile", "token_counts",
]  # fmt: skip
