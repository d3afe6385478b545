"""Model families as data: one `Family` row per transformers MoE architecture.

A row says where the MoE block sits in a decoder layer, what its router and shared
experts are called, and where each canonical piece of an expert comes from in the
checkpoint. A new family whose MoE block has one of these shapes is one more row.

Canonical expert layout (what a pool slot holds, see formats/layout.py):
    gate [I, H], up [I, H]  -> stored together as w13 [2I, H] (gate rows first)
    down [H, I]             -> w2
    gate_bias [I], up_bias [I], down_bias [H]  (only for families with expert biases)

An `ExpertSource` reads one piece either from a per-expert tensor (`{e}` in the name)
or from a fused tensor with a leading expert dimension, then applies `op`:
    copy   as stored
    T      transposed ([I, H] stored as [H, I], i.e. `x @ W` convention)
    T_even / T_odd   transpose, then every other row (gate/up interleaved in one tensor)
    even / odd       every other row (or element, for biases): gate/up interleaved
    top / bottom     the first / second half of the rows (or elements): gate/up concatenated
    T_top / T_bottom transpose, then the first / second half of the rows
A fused tensor may also hold the experts stacked along its rows, [E * rows, ...] (DBRX's w1 / v1 / w2):
the reader takes it as the [E, rows, ...] it is byte for byte.

Routing: a row's router module returns (logits, top-k weights, top-k ids), the weights scaling each expert's
output, except where `scaled_input` says the family scales each expert's input instead (Llama-4).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from moetier.errors import UnknownArchitectureError
from moetier.formats.layout import ExpertSource

OPS = ("copy", "T", "T_even", "T_odd", "even", "odd", "top", "bottom", "T_top", "T_bottom")


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]
    architectures: tuple[str, ...]
    sources: dict[str, ExpertSource]  # piece name -> source; pieces: gate, up, down, *_bias
    intermediate_attr: str  # config attribute with the routed expert's intermediate size
    expert_kind: str = "swiglu"  # "swiglu" (act(gate) * up), "gptoss" (clamped, biased, alpha-sigmoid), or "module"
    # (the seam: the family experts module's own gating, models/seam.py)
    scoring: str = "softmax"  # how router logits become probabilities: softmax | sigmoid | topk_softmax
    block_attr: str = "mlp"  # attribute of the decoder layer holding the MoE block
    ckpt_block: str = "mlp"  # that block's name inside checkpoint tensor names
    router_attr: str = "gate"  # router submodule of the MoE block (kept as is: exact by construction)
    shared_attr: str | None = None  # shared-expert MLP submodule, added to every token's output
    shared_gate_attr: str | None = None  # per-token sigmoid gate of the shared expert (Qwen2-MoE)
    returns_router_scores: bool = False  # block returns (hidden, router_scores) (GPT-OSS)
    # Llama-4: the router returns (scores [T, E], zero outside the top k; logits [T, E]) and a chosen expert runs on
    # the input scaled by its score, the outputs summed unweighted: sum_k expert(w_k * x), not sum_k w_k * expert(x)
    scaled_input: bool = False
    lean_attention: str | None = None  # attention kind the engine's own decoder implements, or None
    # the router the native decode step computes (kernels/csrc/step.c), or None (the family's module routes):
    # "softmax_topk": softmax, top-k, renormalised when config.norm_topk_prob, weights in the model dtype (Qwen,
    # OLMoE); "softmax_topk_renorm": always renormalised, fp32 weights (Mixtral); "topk_softmax": the router's bias
    # added, softmax over the top-k logits (= softmax, top-k, renormalised), weights in the model dtype (GPT-OSS)
    native_router: str | None = None
    extra_renames: tuple[tuple[str, str], ...] = field(default=())  # checkpoint -> model name fragments
    seam: bool = False  # run transformers' own MoE blocks with moetier's experts module (models/seam.py)
    ckpt_names: Mapping[str, str] = field(default_factory=dict)  # seam: non-expert model name -> checkpoint name
    conversions: Mapping[str, Any] = field(default_factory=dict)  # seam: non-expert tensors transformers converts

    def renormalizes_topk(self, config: Any) -> bool:
        """Whether the native router renormalises its top-k weights for this model's config (see native_router)."""
        return self.native_router in ("softmax_topk_renorm", "topk_softmax") or bool(
            getattr(config, "norm_topk_prob", False)
        )

    def __post_init__(self) -> None:
        for piece, src in self.sources.items():
            if src.op not in OPS:
                raise ValueError(f"family {self.name}: piece {piece} has unknown op {src.op!r}")
        for needed in ("gate", "up", "down"):
            if needed not in self.sources:
                raise ValueError(f"family {self.name}: no source for expert piece {needed!r}")


def _per_expert(gate: str, up: str, down: str) -> dict[str, ExpertSource]:
    return {
        "gate": ExpertSource(f"experts.{{e}}.{gate}.weight"),
        "up": ExpertSource(f"experts.{{e}}.{up}.weight"),
        "down": ExpertSource(f"experts.{{e}}.{down}.weight"),
    }


_QWEN_STYLE = _per_expert("gate_proj", "up_proj", "down_proj")

FAMILIES: tuple[Family, ...] = (
    Family(
        name="mixtral", model_types=("mixtral",), architectures=("MixtralForCausalLM",),
        sources=_per_expert("w1", "w3", "w2"), intermediate_attr="intermediate_size",
        ckpt_block="block_sparse_moe", lean_attention="llama", native_router="softmax_topk_renorm",
    ),
    Family(
        name="qwen2_moe", model_types=("qwen2_moe",), architectures=("Qwen2MoeForCausalLM",),
        sources=_QWEN_STYLE, intermediate_attr="moe_intermediate_size",
        shared_attr="shared_expert", shared_gate_attr="shared_expert_gate", lean_attention="llama",
        native_router="softmax_topk",
    ),
    Family(
        name="qwen3_moe", model_types=("qwen3_moe",), architectures=("Qwen3MoeForCausalLM",),
        sources=_QWEN_STYLE, intermediate_attr="moe_intermediate_size", lean_attention="llama",
        native_router="softmax_topk",
    ),
    Family(
        name="olmoe", model_types=("olmoe",), architectures=("OlmoeForCausalLM",),
        sources=_QWEN_STYLE, intermediate_attr="intermediate_size", lean_attention="llama",
        native_router="softmax_topk",
    ),
    Family(
        name="deepseek_v2", model_types=("deepseek_v2",), architectures=("DeepseekV2ForCausalLM",),
        sources=_QWEN_STYLE, intermediate_attr="moe_intermediate_size", shared_attr="shared_experts",
    ),
    Family(
        name="deepseek_v3", model_types=("deepseek_v3",), architectures=("DeepseekV3ForCausalLM",),
        sources=_QWEN_STYLE, intermediate_attr="moe_intermediate_size", shared_attr="shared_experts",
        scoring="sigmoid",
    ),
    Family(
        name="gpt_oss", model_types=("gpt_oss",), architectures=("GptOssForCausalLM",),
        sources={
            "gate": ExpertSource("experts.gate_up_proj", "T_even"),
            "up": ExpertSource("experts.gate_up_proj", "T_odd"),
            "down": ExpertSource("experts.down_proj", "T"),
            "gate_bias": ExpertSource("experts.gate_up_proj_bias", "even"),
            "up_bias": ExpertSource("experts.gate_up_proj_bias", "odd"),
            "down_bias": ExpertSource("experts.down_proj_bias"),
        },
        intermediate_attr="intermediate_size", expert_kind="gptoss", scoring="topk_softmax",
        router_attr="router", returns_router_scores=True, lean_attention="llama",  # with sinks and sliding windows
        native_router="topk_softmax",
    ),
    Family(
        name="llama4", model_types=("llama4_text",), architectures=("Llama4ForCausalLM",),
        sources={
            "gate": ExpertSource("experts.gate_up_proj", "T_top"),  # [E, H, 2I], x @ W, gate columns first
            "up": ExpertSource("experts.gate_up_proj", "T_bottom"),
            "down": ExpertSource("experts.down_proj", "T"),  # [E, I, H]
        },
        intermediate_attr="intermediate_size", scoring="sigmoid", block_attr="feed_forward",
        ckpt_block="feed_forward", router_attr="router", shared_attr="shared_expert", returns_router_scores=True,
        scaled_input=True,
    ),
)  # fmt: skip

# transformers MoE families moetier refuses at open, by model_type, and why (docs/engine.md lists every refused family)
REFUSED: dict[str, str] = {
    "jetmoe": "JetMoE's attention is itself a mixture of experts (MoA: routed per-expert query and output "
              "projections), which moetier does not offload, and neither of its expert modules (JetMoeParallelExperts, "
              "fed tokens pre-sorted by expert) is behind transformers' experts seam",
    "longcat_flash": "LongCat-Flash also routes tokens to zero-computation experts (router ids >= n_routed_experts: "
                     "the token itself, scaled by its gate weight), and its gate_up_proj holds n_routed_experts + "
                     "zero_expert_num experts against down_proj's n_routed_experts; moetier's experts are stored FFNs "
                     "only",
    "doge": "Doge's routed experts are single-neuron product-key experts (one row each of its down_embed / up_embed "
            "tables, ungated, chosen by a two-key product router), not FFNs with a gate, up and down projection",
    "llama4": "a Llama-4 composite (vision + text) checkpoint; moetier runs Llama-4's text model (model_type "
              "llama4_text, Llama4ForCausalLM, the llama4 row) and does not map a composite's language-model and "
              "vision tensors onto it",
}  # fmt: skip


def find_row(model_type: str | None, architectures: list[str] | None) -> Family | None:
    """The row for a checkpoint's config, by architecture name first, then model_type; None without one."""
    for arch in architectures or []:
        for fam in FAMILIES:
            if arch in fam.architectures:
                return fam
    for fam in FAMILIES:
        if model_type in fam.model_types:
            return fam
    return None


def find_family(model_type: str | None, architectures: list[str] | None) -> Family:
    """The row for a checkpoint's config; UnknownArchitectureError without one."""
    row = find_row(model_type, architectures)
    if row is not None:
        return row
    known = ", ".join(a for f in FAMILIES for a in f.architectures)
    raise UnknownArchitectureError(
        f"unsupported architecture {architectures or []} (model_type {model_type!r}); moetier knows: {known}. "
        "A family whose MoE block has one of these shapes is added as a row in moetier/models/families.py"
    )
