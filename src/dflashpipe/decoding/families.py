"""Target families on the static models: what differs between them, layer by layer, run with the
model's own modules and weights (its norms, activations, rotary embedding, experts).

    family        attention                                 MLP                   windows
    llama         q/k/v (biases optional)                   SwiGLU gate/up/down   -
    qwen2, qwen3  q/k/v biases; qwen3 per-head q/k RMSNorm  SwiGLU                layer_types
    mistral       as llama                                  SwiGLU                every layer
    phi3          fused qkv_proj, partial RoPE              fused gate_up_proj    every layer
    qwen3_moe     per-head q/k RMSNorm                      the model's sparse    every layer
                                                            block (router+experts)
    gemma3_text   q/k RMSNorm, query_pre_attn_scalar        GeGLU; norms after    layer_types
                  scaling, RoPE per layer type              attention and around  (5 of 6)
                  (local/global theta)                      the MLP
    gpt_oss       q/k/v/o biases, per-head sink logits,     the model's experts   layer_types
                  RoPE over the two halves (YaRN)                                 (alternate)

"every layer": config.sliding_window, when set, on all layers; "layer_types": on the config's
sliding_attention layers.

Gemma 3's sqrt(H)-scaled embedding is its embedding module's own forward, and its final logit
soft-capping (when set) is applied to the LM head's output (`final_softcap`). A window w lets a
query at position p see keys at positions p-w+1..p (transformers' `kv_idx > q_idx - w`); over a
static cache it is one more condition on the step's mask (`windowed`), built once per step per
distinct window, so sliding and full layers share one compiled layer function.

Families not in FAMILIES (and configurations a family's HF code would decode differently:
run-time RoPE, bidirectional attention) are refused by `check_target_config`; they run on the
eager loop (evaluate) or generate() (regenerate).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflashpipe.model import apply_rope


@dataclass(frozen=True)
class Family:
    """How a family's HF code lays out windows and RoPE. `windows`: "none", "layer_types" (the
    config's sliding_attention layers) or "all" (config.sliding_window on every layer, when set);
    `rope_per_layer_type`: its rotary embedding takes the layer type (Gemma 3); `half_rope`: its
    cos/sin cover D/2 and rotate the two halves (gpt-oss), the same products as rotate_half."""

    windows: str = "layer_types"
    rope_per_layer_type: bool = False
    half_rope: bool = False


FAMILIES = {
    "llama": Family(windows="none"),
    "qwen2": Family(),
    "qwen3": Family(),
    "mistral": Family(windows="all"),
    "phi3": Family(windows="all"),
    "qwen3_moe": Family(windows="all"),
    "gemma3_text": Family(rope_per_layer_type=True),
    "gpt_oss": Family(half_rope=True),
}
SUPPORTED_TARGETS = tuple(FAMILIES)
# RoPE types whose frequencies change with the sequence length at run time: a table computed once
# for max_len positions would differ from the model's own per-call values.
RUNTIME_ROPE = ("dynamic", "longrope")


def check_target_config(config, name: str = "target") -> None:
    """Refuse (ValueError naming the model type and what to do) a target the static models do not
    reproduce, from its transformers config alone (before its weights load)."""
    tc = config.get_text_config()
    kind = getattr(tc, "model_type", name)
    if kind not in FAMILIES:
        raise ValueError(
            f"StaticTarget supports model types {SUPPORTED_TARGETS}, not {kind!r}; "
            "decode it with the eager loop (evaluate) or generate() (regenerate)"
        )
    params = getattr(tc, "rope_parameters", None) or {}
    nested = [p for p in params.values() if isinstance(p, dict)] if params else []
    for p in nested or [params or getattr(tc, "rope_scaling", None) or {}]:
        rope_type = p.get("rope_type", p.get("type", "default"))
        if rope_type in RUNTIME_ROPE:
            raise ValueError(
                f"{kind} target uses rope_type {rope_type!r}, whose frequencies depend on the "
                "sequence length at run time; StaticTarget supports static RoPE types only"
            )
    if getattr(tc, "use_bidirectional_attention", False):
        raise ValueError(
            f"{kind} target has use_bidirectional_attention set (an encoder); StaticTarget "
            "decodes causal models only"
        )


def check_target(model: nn.Module) -> None:
    """`check_target_config` of a loaded model."""
    check_target_config(model.config, type(model).__name__)


def family(config) -> Family:
    return FAMILIES[config.get_text_config().model_type]


def head_shape(config) -> tuple[int, int, int]:
    """(query heads, key/value heads, head_dim) of a target's attention."""
    tc = config.get_text_config()
    heads = tc.num_attention_heads
    kv = getattr(tc, "num_key_value_heads", None) or heads
    return heads, kv, getattr(tc, "head_dim", None) or tc.hidden_size // heads


def layer_windows(config) -> list[int | None]:
    """Per decoder layer its sliding window (None: full attention), as the family's HF code
    masks it."""
    tc = config.get_text_config()
    n, rule = tc.num_hidden_layers, family(config).windows
    window = getattr(tc, "sliding_window", None)
    if rule == "none" or window is None:
        return [None] * n
    if rule == "all":
        return [window] * n
    types = getattr(tc, "layer_types", None) or ["full_attention"] * n
    return [window if t == "sliding_attention" else None for t in types]


def rope_tables(
    base: nn.Module, cols: Tensor, dtype: torch.dtype
) -> tuple[list[tuple[Tensor, Tensor]], list[int]]:
    """The model's own rotary embedding over every slot once (per position the same float32 math
    as its per-call forward, cast to the hidden dtype): tables (cos, sin) (L, D or the rotary
    dim), one per RoPE kind, and per decoder layer the index of its table."""
    tc = base.config.get_text_config()
    fam = family(base.config)
    n = tc.num_hidden_layers
    keys = list(tc.layer_types) if fam.rope_per_layer_type else [None] * n
    kinds = list(dict.fromkeys(keys))
    probe = torch.zeros(1, dtype=dtype, device=cols.device)
    takes_type = "layer_type" in inspect.signature(base.rotary_emb.forward).parameters
    tables = []
    with torch.no_grad():
        for key in kinds:
            extra = [key] if key is not None and takes_type else []
            cos, sin = base.rotary_emb(probe, cols[None], *extra)  # (1, L, D')
            if fam.half_rope:  # x1*cos - x2*sin, x2*cos + x1*sin == rotate_half on [cos, cos]
                cos, sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
            tables.append((cos[0], sin[0]))
    return tables, [kinds.index(k) for k in keys]


def graph_safe_experts(model: nn.Module, graphs: bool, compiled: bool) -> str | None:
    """Set a mixture-of-experts target's experts implementation to one its step functions can
    be compiled whole and captured with (transformers' `set_experts_implementation`); returns
    the new one, None where nothing changed. "eager" loops over the experts hit (a host sync,
    and a graph break): refused by fullgraph compilation; "grouped_mm" is captured in bf16 only
    (other dtypes, under compilation, fall back to a loop that reads the group sizes back to
    the host: the float32 lossless pass on a GPU). "batched_mm" gathers each token's experts'
    weights and runs them as batched matmuls: fixed shapes, no sync, any dtype."""
    impl = getattr(model.config, "_experts_implementation", None)
    moe = any(runs_experts(layer.mlp) for layer in model.get_decoder().layers)
    if not moe or impl == "batched_mm" or not (graphs or compiled):
        return None
    if impl == "eager" or (graphs and not (impl == "grouped_mm" and model.dtype == torch.bfloat16)):
        model.set_experts_implementation("batched_mm")
        return "batched_mm"
    return None


def runs_experts(mlp: nn.Module) -> bool:
    """Whether a decoder layer's MLP is a mixture of experts (run as the model's own module)
    rather than a gate/up/down MLP (run fused)."""
    return not hasattr(mlp, "gate_proj") and not isinstance(
        getattr(mlp, "gate_up_proj", None), nn.Linear
    )


def final_softcap(config) -> float | None:
    """Gemma's final logit soft-capping, None for the others."""
    return getattr(config.get_text_config(), "final_logit_softcapping", None)


def windowed(mask: Tensor, q_pos: Tensor, k_pos: Tensor, window: int | None) -> Tensor:
    """mask (..., Q, L) limited to keys within `window` positions of their query: q_pos (..., Q),
    k_pos (..., L) (a slot's position; in a tree, siblings share one)."""
    if window is None:
        return mask
    return mask & (q_pos[..., :, None] - k_pos[..., None, :] < window)


def fold_mask(mask: Tensor, groups: int) -> Tensor:
    """A bool mask (Q, L), or one per row (N, Q, L), in the layout `attend_cache` takes:
    (N, 1, groups*Q, L) (N = 1 for a (Q, L) mask). Built once per step and shared by every
    layer; a view where each row has one query (a decode step), a copy otherwise."""
    rows = mask if mask.dim() == 3 else mask[None]
    N, Q, L = rows.shape
    return rows[:, None].expand(N, groups, Q, L).reshape(N, 1, groups * Q, L)


def attend_cache(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float | None,
    sinks: Tensor | None = None, softcap: float | None = None, kernel: bool = False,
) -> Tensor:  # fmt: skip
    """Attention of queries q (N, Hq, Q, D) over whole static buffers k, v (N, Hkv, L, D) under a
    folded mask (1 or N, 1, g*Q, L) -> (N, Hq, Q, D); N = 1 but in batched decoding (a sequence
    per row). The g = Hq/Hkv query heads sharing a KV head are folded into the query length
    (head h = kv*g + r, as HF's repeat_kv orders them), so no backend needs GQA support and no
    buffer is expanded per step. `sinks` (Hq,): gpt-oss's per-head sink logit, one more column
    of the softmax whose weight is dropped; `softcap`: tanh capping of the scores (Gemma 2 form).

    Uncompiled (CPU, prefill, graphs alone) without sinks or capping: SDPA's kernel. Otherwise
    the same attention in plain ops as HF's eager attention computes it (scores in the model's
    dtype, softmax in float32), which the compiler fuses into a few kernels around two matmuls.
    H200, SmolLM2 shape, bf16, torch 2.11 (benchmarks/RESULTS.md): compiled target-only step
    1.44 ms with these ops against 1.67 ms with cuDNN's SDPA kernel at 496 slots, 1.63 against
    2.30 ms at 2,048 slots (cuDNN's kernel takes ~45 us per layer call whatever the valid
    length). `kernel`: SDPA's kernel compiled too (a prefill pack's T x T attention, whose
    scores in plain ops would be written and read again: g*T x T per KV head and layer)."""
    N, Hq, Q, D = q.shape
    Hkv = k.shape[1]
    fq = q.reshape(N, Hkv, Hq // Hkv * Q, D)
    if (torch.compiler.is_compiling() and not kernel) or sinks is not None or softcap is not None:
        scores = (fq @ k.transpose(-1, -2)) * (D**-0.5 if scale is None else scale)
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~mask, float("-inf"))
        if sinks is not None:  # per folded row its head's sink: (1, Hkv, g*Q, 1)
            sink = sinks.to(scores.dtype).view(Hkv, -1, 1).expand(-1, -1, Q).reshape(1, Hkv, -1, 1)
            scores = torch.cat([scores, sink.expand(N, -1, -1, -1)], -1)
        weights = scores.softmax(-1, dtype=torch.float32)
        if sinks is not None:
            weights = weights[..., :-1]
        y = weights.to(v.dtype) @ v
    else:
        y = F.scaled_dot_product_attention(fq, k, v, attn_mask=mask, scale=scale)
    return y.reshape(N, Hq, Q, D)  # (N, Hkv, g*Q, D) -> heads; kernels may return it transposed


Fused = tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]  # q/k/v, gate/up: weight, bias


def fuse_layer(layer: nn.Module) -> Fused:
    """A decoder layer's q/k/v projections as one linear and its gate/up projections as another,
    as serving engines run them: (qkv weight, bias, gate_up weight, bias); gate_up None for a
    mixture-of-experts MLP (run as the model's own module). The modules' own weights (and biases)
    become views of these, so no second copy of the model is kept; Phi-3's are fused already. A
    later `.float()` or `.to()` of the model gives it new tensors, so fuse again after one, and
    save the model before (safetensors refuses tensors that share storage)."""
    attn, mlp = layer.self_attn, layer.mlp
    if hasattr(attn, "qkv_proj"):
        qkv = _weights(attn.qkv_proj)
    else:
        qkv = _fuse([attn.q_proj, attn.k_proj, attn.v_proj])
    if runs_experts(mlp):
        return (*qkv, None, None)
    if hasattr(mlp, "gate_proj"):
        return (*qkv, *_fuse([mlp.gate_proj, mlp.up_proj]))
    return (*qkv, *_weights(mlp.gate_up_proj))


def _weights(linear: nn.Linear) -> tuple[Tensor, Tensor | None]:
    bias = linear.bias.detach() if linear.bias is not None else None
    return linear.weight.detach(), bias


def _fuse(linears: Sequence[nn.Linear]) -> tuple[Tensor, Tensor | None]:
    biased = {lin.bias is not None for lin in linears}
    if len(biased) > 1:
        raise ValueError(f"cannot fuse linears where only some have a bias: {linears}")
    weight = torch.cat([lin.weight.detach() for lin in linears])
    bias = torch.cat([lin.bias.detach() for lin in linears]) if biased == {True} else None
    start = 0
    for lin in linears:
        end = start + lin.out_features
        lin.weight.data = weight[start:end]
        if bias is not None:
            lin.bias.data = bias[start:end]
        start = end
    return weight, bias


def layer_qkv(layer: nn.Module, x: Tensor, fused: Fused) -> tuple[Tensor, Tensor, Tensor]:
    """A decoder layer's attention inputs before RoPE: q (..., Hq, D), k and v (..., Hkv, D) of
    rows x (..., H): input norm, the fused q/k/v matmul, per-head q/k norms where the family has
    them (Qwen3, Qwen3-MoE, Gemma 3, the DFlash drafter)."""
    attn = layer.self_attn
    # HF attention modules read their KV heads from the config; the drafter's keeps them
    kv_heads = getattr(attn, "num_kv_heads", None) or attn.config.num_key_value_heads
    q, k, v = project_qkv(layer.input_layernorm(x), fused, kv_heads, attn.head_dim)
    if hasattr(attn, "q_norm"):
        q, k = attn.q_norm(q), attn.k_norm(k)
    return q, k, v


def project_qkv(h: Tensor, fused: Fused, kv_heads: int, D: int) -> tuple[Tensor, Tensor, Tensor]:
    """q (..., Hq, D), k and v (..., Hkv, D) of normed rows h (..., H) in one matmul."""
    qkv = F.linear(h, fused[0], fused[1])
    kv = kv_heads * D
    q, k, v = qkv.split([qkv.shape[-1] - 2 * kv, kv, kv], -1)
    return q.unflatten(-1, (-1, D)), k.unflatten(-1, (-1, D)), v.unflatten(-1, (-1, D))


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE on x (..., D) by rows cos/sin of its positions; a table narrower than D (Phi-3's
    partial rotary factor) rotates the first dims and passes the rest."""
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return apply_rope(x, cos, sin)
    return torch.cat([apply_rope(x[..., :r], cos, sin), x[..., r:]], -1)


def layer_attention(
    layer: nn.Module, q: Tensor, k: Tensor, v: Tensor, mask: Tensor, kernel: bool = False
) -> Tensor:
    """`attend_cache` with the layer's own scaling (Gemma 3: query_pre_attn_scalar; none, so
    1/sqrt(D), for the drafter), sink logits (gpt-oss) and score soft-capping, where it has them;
    `kernel` as there."""
    attn = layer.self_attn
    sinks = getattr(attn, "sinks", None)
    softcap = getattr(attn, "attn_logit_softcapping", None)
    return attend_cache(q, k, v, mask, getattr(attn, "scaling", None), sinks, softcap, kernel)


def attention_extras(model: nn.Module) -> str:
    """What a target's attention adds to a plain scaled softmax that `layer_attention` computes
    ("sink logits", "score soft-capping"); "" when nothing."""
    attn = model.get_decoder().layers[0].self_attn
    extras = [name for name, attr in (("sink logits", "sinks"),
                                      ("score soft-capping", "attn_logit_softcapping"))
              if getattr(attn, attr, None) is not None]  # fmt: skip
    return " and ".join(extras)


def layer_out(layer: nn.Module, x: Tensor, y: Tensor, fused: Fused) -> Tensor:
    """The rest of a target decoder layer: rows x (..., H) plus the output projection of their
    attention y (..., Hq*D), then the residual MLP; Gemma 3 norms the attention output and the
    MLP's input and output (its post_attention_layernorm is not the MLP's input norm)."""
    a = layer.self_attn.o_proj(y)
    if hasattr(layer, "pre_feedforward_layernorm"):
        x = x + layer.post_attention_layernorm(a)
        h = fused_mlp(layer.mlp, layer.pre_feedforward_layernorm(x), fused)
        return x + layer.post_feedforward_layernorm(h)
    x = x + a
    return x + fused_mlp(layer.mlp, layer.post_attention_layernorm(x), fused)


def fused_mlp(mlp: nn.Module, x: Tensor, fused: Fused) -> Tensor:
    """down(act(gate(x)) * up(x)) with gate and up in one matmul; a mixture of experts through the
    model's own module (router and experts, whatever experts implementation it is set to), on the
    rows as one (1, N, H) sequence, its router scores dropped."""
    if fused[2] is None:
        out = mlp(x.reshape(1, -1, x.shape[-1]))
        out = out[0] if isinstance(out, tuple) else out
        return out.reshape(x.shape)
    gate, up = F.linear(x, fused[2], fused[3]).chunk(2, -1)
    act = mlp.act_fn if hasattr(mlp, "act_fn") else mlp.activation_fn
    return mlp.down_proj(act(gate) * up)
