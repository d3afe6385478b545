"""The engine's own decoder for llama-style attention (Mixtral, Qwen2/3-MoE, OLMoE).

transformers' per-layer module stack costs more per decoded token than reading the
active weights does, so the engine runs its own lean loop over the same weights:
fused QKV projection, a preallocated KV cache per layer, a rotary table computed
once by the family's own rotary module, and scaled_dot_product_attention with GQA.
The MoE blocks are the TieredMoE modules of the model (same pipeline, same store);
dense MLP layers call the model's own module.

Supported variants: q/k/v and output biases (Qwen2-MoE, attention_bias), per-head q/k
RMSNorm (Qwen3-MoE), whole-projection q/k RMSNorm then qkv clipping (OLMoE), every rope
type whose table depends only on the position (a family's half-width table, GPT-OSS's, is
widened to rotate-half form), GPT-OSS's per-head attention sinks and per-layer sliding windows
(`layer_types` "sliding_attention", the attention module's `sliding_window`: a row attends to
its last `sliding_window` positions). A family-wide sliding window without per-layer types
(Mixtral's, Qwen2's `use_sliding_window`) and longrope are refused by `lean_supported`, and the
engine falls back to the transformers modules.

Invariants: logits equal the transformers modules' (fp32 exact up to rounding; `norm` is the same math
as transformers' RMSNorm); `run` never writes past a cache's max_len (ConfigError first).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from moetier.errors import ConfigError
from moetier.kernels import decode, ggml
from moetier.kernels.decode import QDense
from moetier.runtime.loader import LoadedModel
from moetier.store import hostmem


@dataclass
class LeanLayer:
    in_norm: torch.Tensor  # [H]
    post_norm: torch.Tensor  # [H]
    wqkv: torch.Tensor | QDense  # [(nh + 2 nkv) * hd, H]
    bqkv: torch.Tensor | None
    wo: torch.Tensor | QDense  # [H, nh * hd]
    bo: torch.Tensor | None  # [H] (attention_bias)
    q_norm: torch.Tensor | None  # [hd] (per head) or [nh * hd] (whole projection)
    k_norm: torch.Tensor | None
    mlp: nn.Module  # TieredMoE or the family's dense MLP
    sinks: torch.Tensor | None = None  # [nh]: each head's sink logit, in its softmax's denominator (GPT-OSS)
    window: int = 0  # > 0: the layer attends to the last `window` positions (a sliding-window layer)


class FusedStep(Protocol):
    """The decoder's layers as native calls (runtime/native_step.py NativeStep), set by the wiring."""

    def run_sequence(self, ids: torch.Tensor, p0: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     all_logits: bool, hidden: bool) -> torch.Tensor: ...

    def run_rows(self, tokens: torch.Tensor, pos: list[int], caches: list[tuple[torch.Tensor, torch.Tensor]]
                 ) -> torch.Tensor: ...

    def head(self, x: torch.Tensor) -> torch.Tensor: ...

    def stats(self) -> dict[str, Any]: ...

    @property
    def wide(self) -> bool:
        """Whether its residual stream, and the rows `run_sequence(hidden=True)` returns, are fp32 (the wide step)."""
        ...

    @property
    def checked(self) -> torch.Tensor | None:
        """The last logits it returned when it found every one of them finite (the caller need not scan them)."""
        ...


def lean_supported(loaded: LoadedModel) -> bool:
    cfg = loaded.config
    if loaded.family.lean_attention != "llama":
        return False
    types = set(getattr(cfg, "layer_types", None) or ["full_attention"])
    if not types <= {"full_attention", "sliding_attention"}:
        return False
    layers: Any = loaded.model.get_submodule("model.layers")
    if "sliding_attention" in types and not all(hasattr(layer.self_attn, "sliding_window") for layer in layers):
        return False  # the window per layer is read from each attention module
    if getattr(cfg, "use_sliding_window", False) or (
        getattr(cfg, "sliding_window", None) and loaded.family.name == "mixtral"
    ):
        return False
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type", "default")) == "longrope":
        return False  # its table depends on the sequence length; transformers' modules handle it
    layer0: Any = loaded.model.get_submodule("model.layers.0")
    attn = layer0.self_attn
    return all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj"))


def attention_dims(cfg: Any) -> tuple[int, int, int]:
    """(query heads, key/value heads, head dim) of a llama-style attention config: the key/value heads default
    to the query heads (no GQA), the head dim to hidden_size // query heads."""
    nh = int(cfg.num_attention_heads)
    nkv = int(getattr(cfg, "num_key_value_heads", None) or nh)
    hd = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // nh)
    return nh, nkv, hd


def kv_token_bytes(cfg: Any, dtype: torch.dtype) -> int:
    """KV cache bytes one token takes: k and v, [key/value heads, head dim] each, in every layer, in `dtype`.
    The one formula of it: the lean decoder's cache and the batch slots' caches hold exactly this per token, and
    the batch runner's serial mode reserves it per token (runtime/batch.py)."""
    _, nkv, hd = attention_dims(cfg)
    return 2 * int(cfg.num_hidden_layers) * nkv * hd * dtype.itemsize


class LeanDecoder:
    def __init__(
        self, loaded: LoadedModel, max_seq_len: int = 0, dense_precision: str = "full", native: bool = False,
        stored: Callable[[str], QDense | None] | None = None,
    ) -> None:
        """`native`: the decode kernels are loaded (kernels/decode.py); the projections of up to
        decode.native_rows() rows take them. `dense_precision` int8 / int4 quantises the attention projections
        (Q8_0 / Q4_0 blocks, needs `native`) and the output head (Q8_0; under int4 Q6_K where ggml quantises and
        computes it, as llama.cpp's Q4_0 files hold it); the bf16 copies stay in the
        model's modules. `stored` (checkpoint tensor name -> the tensor as a stored QDense, or None) gives the
        projections and the head as the file stores them (GGUF blocks, GPTQ / AWQ int4; a fused q/k/v only when
        all three have one type), computed by the native kernels; the rest as above (so `dense_precision` still
        quantises what the file keeps in bf16, e.g. a GPTQ checkpoint's output head)."""
        cfg, model = loaded.config, loaded.model
        if dense_precision != "full" and not native:
            raise ConfigError(f"dense precision {dense_precision} needs the native decode kernels")
        self.native = native
        self.dense_bits = decode.DENSE_BITS.get(dense_precision, 0)
        self.stored = stored if native else None  # before dense_precision: what the file stores quantized stays so
        self._names = {id(p): n for n, p in model.named_parameters()}  # parameter -> checkpoint tensor name
        self.stored_weights = 0  # projections (fused q/k/v counted once) and head computed as stored
        inner: Any = model.model  # the family's base model (embed_tokens, layers, norm, rotary_emb)
        self.device, self.dtype = loaded.device, loaded.dtype
        self.nh, self.nkv, self.hd = attention_dims(cfg)
        self.token_bytes = kv_token_bytes(cfg, self.dtype)  # KV cache bytes per cached token (k and v, every layer)
        self.eps = float(cfg.rms_norm_eps)
        self.clip = getattr(cfg, "clip_qkv", None)
        limit = int(getattr(cfg, "max_position_embeddings", 4096))
        if max_seq_len > limit:
            raise ConfigError(f"max_seq_len {max_seq_len} exceeds the model's max_position_embeddings of {limit}")
        self.max_len = max_seq_len or min(limit, 4096)
        self.embed = inner.embed_tokens.weight  # [V, H]
        self.final_norm = inner.norm.weight  # [H]
        full: Any = model
        head = full.get_output_embeddings()
        # the output head: under int4 at 6.6 bits (Q6_K, by ggml's quantiser and dot product), as llama.cpp's Q4_0 files
        # keep it, else (no ggml, K not whole 256s) at 8; under int8 at 8
        self.lm_head = self._stored_or((head.weight,)) or self._head(head.weight)
        self.layers = [self._layer(layer) for layer in inner.layers]
        self.per_head_norm = self.layers[0].q_norm is not None and self.layers[0].q_norm.numel() == self.hd
        # 1. rotary table from the family's own rotary module: cos/sin [max_len, hd]
        pos = torch.arange(self.max_len, device=self.device)[None]
        probe = torch.zeros(1, dtype=self.dtype, device=self.device)
        cos, sin = inner.rotary_emb(probe, pos)
        if cos.shape[-1] * 2 == self.hd:  # a half-width table (GPT-OSS): the same rotation in rotate-half form
            cos, sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
        self.cos, self.sin = cos[0], sin[0]
        # 2. KV cache, allocated once: [L][nkv, max_len, hd]
        self.kv_dtype = self.dtype  # the native step's wide mode keeps fp16 caches (`set_kv_dtype`)
        self.set_kv_dtype(self.dtype)
        self.pos = 0
        self.fused: FusedStep | None = None  # the native step, when the wiring gives one (bf16 CPU models)

    def set_kv_dtype(self, dtype: torch.dtype) -> None:
        """(Re)allocate the decoder's KV cache [L][nkv, max_len, hd] in `dtype` (batch slots take it too)."""
        shape = (len(self.layers), self.nkv, self.max_len, self.hd)
        self.kv_dtype = dtype
        self.k_cache = torch.empty(shape, dtype=dtype, device=self.device)  # untouched pages cost no RSS
        self.v_cache = torch.empty(shape, dtype=dtype, device=self.device)

    def _dense(self, w: torch.Tensor, bits: int | None = None) -> torch.Tensor | QDense:
        """A projection's weight as the decoder reads it: quantised to `bits` (default dense_bits) when set."""
        bits = self.dense_bits if bits is None else bits
        return _huge(decode.quantize_dense(w.detach(), bits)) if bits else w

    def _head(self, w: torch.Tensor) -> torch.Tensor | QDense:
        if self.dense_bits == 4:
            q6 = ggml.quantize("Q6_K", w.detach())
            got = decode.stored_dense("Q6_K", q6, w.shape[1]) if q6 is not None else None
            if got is not None:
                return _huge(got)
        return self._dense(w, 8 if self.dense_bits else 0)

    def _stored_or(self, params: tuple[torch.Tensor, ...]) -> QDense | None:
        """The weights `params` (rows concatenated) as the checkpoint stores them, when `stored` gives every one
        in one block type; else None."""
        if self.stored is None:
            return None
        got = [self.stored(self._names.get(id(p), "")) for p in params]
        if any(g is None for g in got):
            return None
        one = got[0] if len(got) == 1 else decode.concat_dense([g for g in got if g is not None])
        if one is not None:
            self.stored_weights += 1
        return one

    def _layer(self, layer: Any) -> LeanLayer:
        a = layer.self_attn
        projs = (a.q_proj, a.k_proj, a.v_proj)
        stored_qkv = self._stored_or(tuple(p.weight for p in projs))
        stored_o = self._stored_or((a.o_proj.weight,))
        w = fuse_projections(projs, "weight")
        b = fuse_projections(projs, "bias") if a.q_proj.bias is not None else None
        qn, kn = getattr(a, "q_norm", None), getattr(a, "k_norm", None)
        return LeanLayer(
            in_norm=layer.input_layernorm.weight,
            post_norm=layer.post_attention_layernorm.weight,
            wqkv=stored_qkv or self._dense(w), bqkv=b, wo=stored_o or self._dense(a.o_proj.weight), bo=a.o_proj.bias,
            q_norm=qn.weight if qn is not None else None,
            k_norm=kn.weight if kn is not None else None,
            mlp=layer.mlp,
            sinks=getattr(a, "sinks", None),
            window=int(getattr(a, "sliding_window", None) or 0),
        )  # fmt: skip

    def reset(self) -> None:
        self.pos = 0

    def norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """RMSNorm of x [..., H] with weight w [H] (the layers' norms; batch.py uses it too)."""
        # one fused call; same math as transformers' RMSNorm (equal in fp32, rounding-level in bf16); the native
        # op for bf16 rows on the CPU (torch's takes 24-50 us for 1024 values on this project's AVX2 machine)
        if self.native and x.dtype == torch.bfloat16 and x.is_cpu and x.numel() <= 8 * 4096:
            return decode.rms_norm(x, w, self.eps)
        return F.rms_norm(x, (x.shape[-1],), w, self.eps)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, all_logits: bool = False) -> torch.Tensor:
        """ids [1, T] appended at the cache position -> logits [T, V] (all) or [1, V] (last)."""
        out = self.run(ids, self.pos, self.k_cache, self.v_cache, all_logits)
        self.pos += ids.shape[1]
        return out

    def run(
        self, ids: torch.Tensor, p0: int, k_cache: torch.Tensor, v_cache: torch.Tensor, all_logits: bool = False,
        hidden: bool = False,
    ) -> torch.Tensor:  # fmt: skip
        """ids [1, T] written at position p0 of the given cache ([L, nkv, max_len, hd] each; the decoder's
        own or a batch slot's, runtime/batch.py) -> logits [T, V] (all) or [1, V] (last); `hidden`: the last
        layer's output x [T, H] instead (`head` turns rows of it into logits: the batch runner's echo scores
        every prompt position a chunk of rows at a time rather than holding [T, V])."""
        T = ids.shape[1]
        if p0 + T > self.max_len:
            raise ConfigError(f"sequence of {p0 + T} tokens exceeds the KV cache of {self.max_len} (raise max_seq_len)")
        if self.fused is not None:
            return self.fused.run_sequence(ids[0], p0, k_cache, v_cache, all_logits, hidden)
        nh, hd = self.nh, self.hd
        cos, sin = self.cos[p0 : p0 + T, None], self.sin[p0 : p0 + T, None]  # [T, 1, hd]
        mask = None
        if T > 1 and p0 > 0:  # chunk after a prefix: causal within the chunk, all of the prefix
            mask = torch.ones(T, p0 + T, dtype=torch.bool, device=self.device).tril(p0)
        x = F.embedding(ids[0], self.embed)  # [T, H]
        for i, L in enumerate(self.layers):
            q, k, v = self.qkv(L, self.norm(x, L.in_norm), cos, sin)  # [T, nh, hd], [T, nkv, hd] x2
            kc, vc = k_cache[i], v_cache[i]  # [nkv, max_len, hd]
            kc[:, p0 : p0 + T] = k.transpose(0, 1)
            vc[:, p0 : p0 + T] = v.transpose(0, 1)
            if L.sinks is not None or L.window:
                x = self.finish_layer(L, x, self.attend(L, q, kc, vc, p0))
                continue
            att = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None],  # [1, nh, T, hd]
                kc[None, :, : p0 + T],  # [1, nkv, p0+T, hd]
                vc[None, :, : p0 + T],
                attn_mask=mask,
                is_causal=T > 1 and p0 == 0,
                enable_gqa=nh != self.nkv,
            )  # [1, nh, T, hd]
            x = self.finish_layer(L, x, att[0].transpose(0, 1).reshape(T, nh * hd))
        if hidden:
            return x  # [T, H]
        return self.head(x if all_logits else x[-1:])

    def attend(self, L: LeanLayer, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, p0: int) -> torch.Tensor:
        """Attention of q [T, nh, hd] (rows at positions p0 .. p0 + T - 1) over one layer's cache kc / vc
        [nkv, cap, hd] holding positions 0 .. p0 + T - 1, with the layer's sliding window and sinks, as
        transformers' eager attention computes it (scores, the sink column, softmax, the sink dropped) ->
        [T, nh * hd]."""
        T, nh, hd = q.shape
        end = p0 + T
        lo = max(0, p0 - L.window + 1) if L.window else 0  # the first key any row of this call may see
        k = kc[:, lo:end].repeat_interleave(nh // self.nkv, dim=0)  # [nh, n, hd]
        v = vc[:, lo:end].repeat_interleave(nh // self.nkv, dim=0)
        s = torch.matmul(q.transpose(0, 1), k.transpose(1, 2)) * hd**-0.5  # [nh, T, n]
        qpos = torch.arange(p0, end, device=q.device)[:, None]  # [T, 1]
        kpos = torch.arange(lo, end, device=q.device)[None]  # [1, n]
        keep = kpos <= qpos
        if L.window:
            keep &= kpos > qpos - L.window
        s = s.masked_fill(~keep, float("-inf"))
        if L.sinks is not None:
            s = torch.cat([s, L.sinks.to(s.dtype).reshape(nh, 1, 1).expand(nh, T, 1)], dim=-1)  # [nh, T, n + 1]
        s = s - s.amax(dim=-1, keepdim=True)
        p = F.softmax(s, dim=-1, dtype=s.dtype)
        if L.sinks is not None:
            p = p[..., :-1]
        return torch.matmul(p.to(v.dtype), v).transpose(0, 1).reshape(T, nh * hd)  # [T, nh * hd]

    def qkv(
        self, L: LeanLayer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Normed rows h [T, H], rotary cos/sin [T, 1, hd] -> q [T, nh, hd], k and v [T, nkv, hd]."""
        T, nh, nkv, hd = h.shape[0], self.nh, self.nkv, self.hd
        qkv = decode.dense_linear(h, L.wqkv, L.bqkv, self.native)  # [T, (nh + 2 nkv) hd]
        q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], dim=-1)
        if L.q_norm is not None and L.k_norm is not None and not self.per_head_norm:
            q, k = self.norm(q, L.q_norm), self.norm(k, L.k_norm)  # OLMoE: whole projection
        if self.clip is not None:  # OLMoE: clamp after the norm, v too
            q, k, v = (t.clamp(-self.clip, self.clip) for t in (q, k, v))
        q, k, v = q.view(T, nh, hd), k.view(T, nkv, hd), v.view(T, nkv, hd)
        if L.q_norm is not None and L.k_norm is not None and self.per_head_norm:
            q, k = self.norm(q, L.q_norm), self.norm(k, L.k_norm)
        q = q * cos + _rotate_half(q) * sin  # [T, nh, hd]
        k = k * cos + _rotate_half(k) * sin  # [T, nkv, hd]
        return q, k, v

    def finish_layer(self, L: LeanLayer, x: torch.Tensor, att: torch.Tensor) -> torch.Tensor:
        """Residual x [T, H] + output projection of att [T, nh * hd], then the MLP/MoE on all T rows at
        once ([1, T, H]: rows are independent, so T may be T tokens of one sequence or one of T sequences)."""
        x = x + decode.dense_linear(att, L.wo, L.bo, self.native)
        h = self.norm(x, L.post_norm)
        y = L.mlp(h[None])  # [1, T, H] (TieredMoE or dense MLP)
        return x + (y[0] if isinstance(y, tuple) else y)[0]

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: x [T, H] -> logits [T, V] (rows of the native step's residual stream, fp32 when
        it is wide, through its own head)."""
        if self.fused is not None and self.fused.wide:
            return self.fused.head(x)
        return decode.dense_linear(self.norm(x, self.final_norm), self.lm_head, None, self.native)


def _huge(w: QDense) -> QDense:
    """A quantised dense weight with its quants and scales moved onto huge pages (store/hostmem.py; decode streams
    them every token): the copies replace the originals, which are freed."""
    return dataclasses.replace(w, q=hostmem.rehome(w.q), scale=hostmem.rehome(w.scale))


def fuse_projections(projs: tuple[Any, ...], attr: str) -> torch.Tensor:
    """Concatenate the projections' weights (or biases) and re-point the modules at views of the
    fused tensor, so the fused copy does not double the attention weights' memory."""
    parts = [getattr(p, attr) for p in projs]
    # on transparent huge pages where it is a host buffer worth them (store/hostmem.py: decode streams it)
    fused = hostmem.empty((sum(t.shape[0] for t in parts), *parts[0].shape[1:]), parts[0].dtype, parts[0].device)
    torch.cat(parts, 0, out=fused)
    start = 0
    for p in projs:
        n = getattr(p, attr).shape[0]
        setattr(p, attr, nn.Parameter(fused[start : start + n], requires_grad=False))
        start += n
    return fused


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
