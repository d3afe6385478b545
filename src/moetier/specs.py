"""Model specs: the shapes of published MoE models as plain data (torch-free).

A `ModelSpec` holds what the cost model and the simulator need to price a model without
its weights: layer counts, which decoder layers are MoE, routed and shared experts, top-k,
hidden and intermediate sizes, the attention shape (GQA or DeepSeek's MLA) and the vocab.

Sources, in the order `load_spec` tries them:
1. a name of a spec shipped in the package (moetier/data/specs/<name>.json, read through importlib.resources;
   see `spec_names()`);
2. a path to such a .json file;
3. a local Hugging Face checkpoint folder (its config.json, for the families moetier knows).

Invariants:
- Every count and size is a positive int, except those documented as 0 = none
  (num_shared, shared_inter, dense_inter, MLA ranks); moe_layers are distinct, sorted and
  inside [0, num_layers); top_k <= num_experts.
- `shared_inter` is the intermediate size of EACH shared expert: Qwen2-MoE has one shared
  expert of `shared_expert_intermediate_size`; DeepSeek has `n_shared_experts` experts of
  `moe_intermediate_size` each.
- For MLA, `head_dim` is the non-rotary query/key head dim (qk_nope_head_dim); `qk_rope_dim`
  and `v_head_dim` carry the rest.
- Byte counts of quantised experts follow formats/quant.py: int8 one (scale, zero) bf16 pair per
  row, int4 groups of 128, int2 groups of 64 (a smaller group where the dimension needs one).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import MISSING, asdict, dataclass, fields
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

from moetier.errors import ConfigError
from moetier.types import PRECISION_BITS

SHIPPED_SPECS: Traversable = resources.files("moetier") / "data" / "specs"

_GROUP = {"int4": 128, "int2": 64}  # int8: one group per row
_ZERO_OK = {"num_shared", "shared_inter", "dense_inter", "q_lora_rank", "kv_lora_rank", "qk_rope_dim", "v_head_dim"}


def _group(precision: str, k: int) -> int:
    """The group size formats/quant.py uses for a matrix with k input features."""
    want = _GROUP.get(precision, k)
    if k % want == 0:
        return want
    for g in (256, 128, 64, 32):
        if g <= want and k % g == 0:
            return g
    return k


def _matrix_bytes(n: int, k: int, precision: str, dtype_bytes: int) -> int:
    """Bytes of one [n, k] weight at `precision` (q bits + a bf16 scale and zero per group)."""
    if precision not in PRECISION_BITS:
        raise ConfigError(f"unknown precision {precision!r}; expected one of {', '.join(PRECISION_BITS)}")
    if precision == "full":  # not quantised: the model's own dtype
        return n * k * dtype_bytes
    return n * k * PRECISION_BITS[precision] // 8 + n * (k // _group(precision, k)) * 4


def _ffn_bytes(hidden: int, inter: int, precision: str, dtype_bytes: int) -> int:
    """One SwiGLU MLP: gate+up [2I, H] and down [H, I]."""
    return _matrix_bytes(2 * inter, hidden, precision, dtype_bytes) + _matrix_bytes(
        hidden, inter, precision, dtype_bytes
    )


@dataclass(frozen=True)
class ModelSpec:
    name: str
    source: str  # URL of the public config it was taken from (or a local path)
    num_layers: int
    moe_layers: tuple[int, ...]  # decoder layers that have an MoE block
    num_experts: int
    top_k: int
    num_shared: int
    hidden: int
    moe_inter: int
    shared_inter: int  # intermediate size of EACH shared expert (0: none)
    dense_inter: int  # MLP of the non-MoE layers (0: none)
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int
    attention: str = "gqa"  # "gqa" | "mla"
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_rope_dim: int = 0
    v_head_dim: int = 0
    dtype_bytes: int = 2

    def __post_init__(self) -> None:
        object.__setattr__(self, "moe_layers", tuple(self.moe_layers))
        for f in fields(self):
            if f.name in ("name", "source", "attention", "moe_layers"):
                continue
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ConfigError(f"spec {self.name!r}: {f.name} must be an int, got {v!r}")
            if v < 0 or (v == 0 and f.name not in _ZERO_OK):
                raise ConfigError(
                    f"spec {self.name!r}: {f.name} must be {'>= 0' if f.name in _ZERO_OK else '> 0'}, got {v}"
                )
        if not self.name:
            raise ConfigError("spec has an empty name")
        if self.attention not in ("gqa", "mla"):
            raise ConfigError(f"spec {self.name!r}: attention must be 'gqa' or 'mla', got {self.attention!r}")
        if self.top_k > self.num_experts:
            raise ConfigError(f"spec {self.name!r}: top_k {self.top_k} > num_experts {self.num_experts}")
        ml = self.moe_layers
        if not ml or any(isinstance(x, bool) or not isinstance(x, int) for x in ml):
            raise ConfigError(f"spec {self.name!r}: moe_layers must be a non-empty list of ints, got {list(ml)}")
        if list(ml) != sorted(set(ml)) or ml[0] < 0 or ml[-1] >= self.num_layers:
            raise ConfigError(
                f"spec {self.name!r}: moe_layers must be distinct, sorted, in [0, {self.num_layers}), got {list(ml)}"
            )
        if (self.num_shared > 0) != (self.shared_inter > 0):
            raise ConfigError(
                f"spec {self.name!r}: num_shared {self.num_shared} and shared_inter "
                f"{self.shared_inter} must both be 0 or both positive"
            )
        if len(ml) < self.num_layers and self.dense_inter == 0:
            raise ConfigError(f"spec {self.name!r}: has dense layers but dense_inter is 0")
        if self.attention == "mla" and (self.kv_lora_rank == 0 or self.v_head_dim == 0):
            raise ConfigError(f"spec {self.name!r}: MLA needs kv_lora_rank and v_head_dim > 0")

    # 1. Expert bytes -------------------------------------------------------------------------------------------
    def expert_bytes(self, precision: str = "full") -> int:
        """Bytes of one routed expert (3*H*I params) at `precision`."""
        return _ffn_bytes(self.hidden, self.moe_inter, precision, self.dtype_bytes)

    def shared_bytes(self, precision: str = "full") -> int:
        """Bytes of one shared expert (0 when the model has none)."""
        return _ffn_bytes(self.hidden, self.shared_inter, precision, self.dtype_bytes) if self.num_shared else 0

    @property
    def total_expert_bytes(self) -> int:
        """All routed experts of all MoE layers at full precision."""
        return len(self.moe_layers) * self.num_experts * self.expert_bytes("full")

    # 2. Non-expert shape (for the cost model's dense part) -----------------------------------------------------
    def attention_params(self) -> int:
        """Weights of one decoder layer's attention projections (plus MLA's low-rank norms)."""
        h, nh = self.hidden, self.num_heads
        if self.attention == "gqa":
            return h * nh * self.head_dim * 2 + h * self.num_kv_heads * self.head_dim * 2  # q, o + k, v
        qk = self.head_dim + self.qk_rope_dim
        q = h * nh * qk if self.q_lora_rank == 0 else h * self.q_lora_rank + self.q_lora_rank * (1 + nh * qk)
        kv_a = h * (self.kv_lora_rank + self.qk_rope_dim) + self.kv_lora_rank
        kv_b = self.kv_lora_rank * nh * (self.head_dim + self.v_head_dim)
        return q + kv_a + kv_b + nh * self.v_head_dim * h

    def layer_dense_params(self, moe: bool = True) -> int:
        """Non-expert weights of one decoder layer: attention, two norms, and the router (moe=True) or
        the dense MLP (moe=False). Shared experts are priced as experts, not here."""
        mlp = self.num_experts * self.hidden if moe else 3 * self.hidden * self.dense_inter
        return self.attention_params() + 2 * self.hidden + mlp

    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes one token adds to one layer (MLA: the compressed latent plus the rope key)."""
        if self.attention == "mla":
            return (self.kv_lora_rank + self.qk_rope_dim) * self.dtype_bytes
        return 2 * self.num_kv_heads * self.head_dim * self.dtype_bytes

    def attention_flops(self, tokens: int, context: int) -> int:
        """Score and value FLOPs of `tokens` queries over `context` keys (all heads)."""
        qk = self.head_dim + self.qk_rope_dim
        v = self.v_head_dim if self.attention == "mla" else self.head_dim
        return 2 * self.num_heads * (qk + v) * tokens * context

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["moe_layers"] = list(self.moe_layers)
        return d


# 3. Loading -------------------------------------------------------------------------------------------------------
def spec_names() -> list[str]:
    """Names of the specs shipped in the package (moetier/data/specs)."""
    if not SHIPPED_SPECS.is_dir():
        return []
    return sorted(e.name[: -len(".json")] for e in SHIPPED_SPECS.iterdir() if e.name.endswith(".json") and e.is_file())


def spec_from_dict(d: Mapping[str, Any], where: str = "spec") -> ModelSpec:
    """A ModelSpec from its JSON form (unknown keys other than notes are an error)."""
    allowed = {f.name for f in fields(ModelSpec)}
    extra = set(d) - allowed - {"notes", "hf_config"}
    if extra:
        raise ConfigError(f"{where}: unknown spec keys {sorted(extra)}; allowed: {sorted(allowed)}")
    missing = {f.name for f in fields(ModelSpec) if f.default is MISSING} - set(d)
    if missing:
        raise ConfigError(f"{where}: missing spec keys {sorted(missing)}")
    kw = {k: v for k, v in d.items() if k in allowed}
    if not isinstance(kw["moe_layers"], list | tuple):
        raise ConfigError(f"{where}: moe_layers must be a list, got {kw['moe_layers']!r}")
    kw["moe_layers"] = tuple(kw["moe_layers"])
    return ModelSpec(**kw)


def _get(cfg: Mapping[str, Any], *names: str, default: Any = None) -> Any:
    for n in names:
        if cfg.get(n) is not None:
            return cfg[n]
    if default is not None:
        return default
    raise ConfigError(f"config.json has none of {list(names)}")


def spec_from_hf_config(cfg: Mapping[str, Any], name: str, source: str) -> ModelSpec:
    """A ModelSpec from a Hugging Face config.json dict (mixtral, qwen2_moe, qwen3_moe, olmoe,
    deepseek_v2/v3, gpt_oss, glm4_moe)."""
    mt = str(cfg.get("model_type", ""))
    known = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3", "gpt_oss", "glm4_moe")
    if mt not in known:
        raise ConfigError(f"{source}: model_type {mt!r} has no spec reader; known: {', '.join(known)}")
    layers = int(_get(cfg, "num_hidden_layers"))
    hidden = int(_get(cfg, "hidden_size"))
    heads = int(_get(cfg, "num_attention_heads"))
    kv_heads = int(_get(cfg, "num_key_value_heads", default=heads))
    experts = int(_get(cfg, "num_local_experts", "num_experts", "n_routed_experts"))
    top_k = int(_get(cfg, "num_experts_per_tok", "experts_per_token", "moe_top_k"))
    inter = int(_get(cfg, "intermediate_size"))
    kw: dict[str, Any] = {}
    # 1. which decoder layers are MoE
    if mt in ("deepseek_v2", "deepseek_v3", "glm4_moe"):
        first, freq = int(cfg.get("first_k_dense_replace", 0) or 0), int(cfg.get("moe_layer_freq", 1) or 1)
        moe_layers = tuple(i for i in range(layers) if i >= first and i % freq == 0)
    elif mt in ("qwen2_moe", "qwen3_moe"):
        step, only = int(cfg.get("decoder_sparse_step", 1) or 1), set(cfg.get("mlp_only_layers") or [])
        moe_layers = tuple(i for i in range(layers) if i not in only and (i + 1) % step == 0)
    else:
        moe_layers = tuple(range(layers))
    # 2. expert sizes
    if mt in ("mixtral", "olmoe", "gpt_oss"):
        moe_inter, dense_inter = inter, 0
    else:
        moe_inter, dense_inter = int(_get(cfg, "moe_intermediate_size")), inter
    num_shared, shared_inter = 0, 0
    if mt == "qwen2_moe" and int(cfg.get("shared_expert_intermediate_size", 0) or 0) > 0:
        num_shared, shared_inter = 1, int(cfg["shared_expert_intermediate_size"])
    elif mt in ("deepseek_v2", "deepseek_v3", "glm4_moe") and int(cfg.get("n_shared_experts", 0) or 0) > 0:
        num_shared, shared_inter = int(cfg["n_shared_experts"]), moe_inter
    if len(moe_layers) == layers:
        dense_inter = 0
    # 3. attention
    if mt in ("deepseek_v2", "deepseek_v3"):
        kw.update(
            attention="mla",
            q_lora_rank=int(cfg.get("q_lora_rank") or 0),
            kv_lora_rank=int(_get(cfg, "kv_lora_rank")),
            qk_rope_dim=int(_get(cfg, "qk_rope_head_dim")),
            v_head_dim=int(_get(cfg, "v_head_dim")),
        )
        head_dim = int(_get(cfg, "qk_nope_head_dim"))
    else:
        head_dim = int(cfg.get("head_dim") or hidden // heads)
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    return ModelSpec(
        name=name, source=source, num_layers=layers, moe_layers=moe_layers, num_experts=experts, top_k=top_k,
        num_shared=num_shared, hidden=hidden, moe_inter=moe_inter, shared_inter=shared_inter,
        dense_inter=dense_inter, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        vocab=int(_get(cfg, "vocab_size")), dtype_bytes=4 if dtype in ("float32", "fp32") else 2, **kw,
    )  # fmt: skip


def _read_json(path: Path | Traversable) -> Any:
    try:
        return json.loads(path.read_text())
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None


def load_spec(name_or_path: str) -> ModelSpec:
    """A shipped spec by name, a spec .json path, or a local HF checkpoint folder (its config.json)."""
    s = str(name_or_path)
    named = SHIPPED_SPECS / f"{s}.json"
    if "/" not in s and not s.endswith(".json") and named.is_file():
        return spec_from_dict(_read_json(named), str(named))
    p = Path(s)
    if p.is_dir():
        cfg_path = p / "config.json"
        if not cfg_path.is_file():
            raise ConfigError(f"{p} is a folder without config.json; a spec needs a checkpoint folder or a name")
        return spec_from_hf_config(_read_json(cfg_path), p.name, str(cfg_path.resolve()))
    if p.is_file() and p.suffix == ".json":
        d = _read_json(p)
        if not isinstance(d, dict):
            raise ConfigError(f"{p}: a spec file holds a JSON object")
        if "model_type" in d and "num_layers" not in d:
            return spec_from_hf_config(d, p.stem, str(p.resolve()))
        return spec_from_dict(d, str(p))
    raise ConfigError(
        f"unknown model spec {s!r}; known: {', '.join(spec_names())} (or a spec .json path, "
        "or a Hugging Face checkpoint folder)"
    )


def spec_from_trace_metadata(meta: Mapping[str, Any]) -> ModelSpec | None:
    """Best effort: a shipped spec whose name matches the trace's model id, else the model's local checkpoint
    folder, else one built from the trace's own shape keys (attention guessed as a small GQA); None when the
    keys are missing."""
    model = str(meta.get("model", "") or "")
    base = Path(model.rstrip("/")).name.lower()
    for n in spec_names():
        if base and base == n.lower():
            return load_spec(n)
    if model and (Path(model) / "config.json").is_file():
        try:
            return load_spec(model)
        except ConfigError:
            pass
    try:
        e, k = int(meta["num_experts"]), int(meta["top_k"])
        h, i = int(meta["hidden_size"]), int(meta["moe_intermediate_size"])
    except (KeyError, TypeError, ValueError):
        return None
    layers_meta = meta.get("moe_layers")
    if isinstance(layers_meta, str):
        try:
            layers_meta = json.loads(layers_meta)
        except json.JSONDecodeError:
            layers_meta = None
    try:
        moe_layers = tuple(int(x) for x in layers_meta) if layers_meta else ()
        num_layers = int(meta.get("num_layers") or (max(moe_layers) + 1 if moe_layers else 0))
    except (TypeError, ValueError):
        return None
    if num_layers <= 0:
        return None
    if not moe_layers:
        moe_layers = tuple(range(num_layers))
    heads = max(1, h // 64)
    dtype = str(meta.get("dtype", "bfloat16"))
    try:
        return ModelSpec(
            name=base or "trace", source=f"trace metadata ({model or 'unnamed'})", num_layers=num_layers,
            moe_layers=moe_layers, num_experts=e, top_k=k, num_shared=0, hidden=h, moe_inter=i, shared_inter=0,
            dense_inter=0 if len(moe_layers) == num_layers else 4 * h, num_heads=heads,
            num_kv_heads=max(1, heads // 4), head_dim=64, vocab=32000,
            dtype_bytes=4 if "32" in dtype else 2,
        )  # fmt: skip
    except ConfigError:
        return None
