"""The DFlash drafter: a few Qwen3-form decoder layers that denoise a block of mask tokens.

    ctx = hidden_norm(fc(concat of the target's hidden states at target_layer_ids))   (T, H)
    x   = embed([x_a, MASK, ..., MASK])                                               (A, B, H)
    each layer: queries from x; keys/values from [ctx ; x]; then a SwiGLU MLP
    out = norm(x)  ->  the target's LM head gives the logits; slot k predicts x_{a+k}

The layer is the Qwen3 one (per-head q/k RMSNorm) whatever the target family, because published
DFlash drafters and their loaders (`model_type: qwen3`) expect it. `architecture: dflash2` adds a
block-local dynamic convolution around each sublayer and a candidate selector (`dflash2.py`).
The target's embedding and LM head are held frozen; they are never trained or exported. The state
dict names match the published checkpoints, so export is `state_dict()` minus `embed_tokens.*` and
`lm_head.*`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from transformers import PretrainedConfig, Qwen3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    rotate_half,
)

from dflashpipe import layout
from dflashpipe.dflash2 import CandidateSelector, DynamicConv
from dflashpipe.errors import ConfigError
from dflashpipe.layout import default_target_layer_ids
from dflashpipe.masks import Mask, attend, build_masks

LAYER_TYPES = (layout.FULL, layout.SLIDING)
ARCHITECTURES = ("dflash", "dflash2")
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
FROZEN_PREFIXES = ("embed_tokens.", "lm_head.")


def target_context(hidden_states: Sequence[Tensor], target_layer_ids: Sequence[int]) -> Tensor:
    """The drafter's fc input: outputs of the target's decoder layers `target_layer_ids`, concatenated
    on the last dim -> (..., n_taps*H). HF `hidden_states[0]` is the embedding output, so decoder
    layer i's output is entry i+1. (HF's last entry is usually after the final norm; the default
    taps stop at layer N-3.)"""
    return torch.cat([hidden_states[i + 1] for i in target_layer_ids], dim=-1)


@dataclass
class DrafterConfig:
    """Shape of the drafter; the sizes and RoPE settings are the target's (see `from_target`)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    vocab_size: int
    max_position_embeddings: int
    rope_parameters: dict
    num_target_layers: int
    mask_token_id: int
    num_layers: int = 5
    block_size: int = 16
    target_layer_ids: list[int] | None = None  # None: default_target_layer_ids(N, num_layers)
    layer_types: list[str] | None = None  # None: layout.layer_types (window on all but the last)
    sliding_window: int | None = None
    learned_mask_embedding: bool = False  # opt-in; published loaders use the target's row
    architecture: str = "dflash"  # or "dflash2": the convolutions and selector of dflash2.py
    conv_kernel_size: int = 2  # dflash2: taps per convolution (the slot and the one before)
    conv_group_size: int = 16  # dflash2: channels sharing one dynamic scalar per tap
    selector_rank: int = 256  # dflash2: rank of the selector's transition scores
    selector_top_k: int = 16  # dflash2: candidates per drafted slot

    @property
    def dflash2(self) -> bool:
        return self.architecture == "dflash2"

    def __post_init__(self) -> None:
        if self.target_layer_ids is None:
            self.target_layer_ids = default_target_layer_ids(
                self.num_target_layers, self.num_layers
            )
        if self.layer_types is None:
            self.layer_types = layout.layer_types(self.num_layers, self.sliding_window)
        self.target_layer_ids = list(self.target_layer_ids)
        self.layer_types = list(self.layer_types)
        self.rope_parameters = dict(self.rope_parameters)
        self._validate()

    def _validate(self) -> None:
        for name in ("num_layers", "hidden_size", "head_dim", "num_key_value_heads", "vocab_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"drafter {name} must be >= 1, got {getattr(self, name)}")
        if self.block_size < 2:
            raise ConfigError(f"drafter block_size must be >= 2, got {self.block_size}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        bad = [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers]
        if bad or not self.target_layer_ids:
            raise ConfigError(
                f"target_layer_ids {self.target_layer_ids} must be non-empty layer indices of the "
                f"{self.num_target_layers}-layer target (0..{self.num_target_layers - 1})"
            )
        if len(self.layer_types) != self.num_layers:
            raise ConfigError(
                f"layer_types has {len(self.layer_types)} entries, expected num_layers = "
                f"{self.num_layers}"
            )
        if unknown := sorted(set(self.layer_types) - set(LAYER_TYPES)):
            raise ConfigError(f"layer_types {unknown} are not among {LAYER_TYPES}")
        if "sliding_attention" in self.layer_types and not (self.sliding_window or 0) > 0:
            raise ConfigError(
                f"sliding_attention layers need sliding_window > 0, got {self.sliding_window}"
            )
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ConfigError(
                f"mask_token_id {self.mask_token_id} is outside the vocabulary (0..{self.vocab_size - 1})"
            )
        if "rope_theta" not in self.rope_parameters:
            raise ConfigError(f"rope_parameters {self.rope_parameters} lack rope_theta")
        if self.architecture not in ARCHITECTURES:
            raise ConfigError(
                f"drafter architecture {self.architecture!r} is not one of {ARCHITECTURES}"
            )
        if self.dflash2:
            self._validate_dflash2()

    def _validate_dflash2(self) -> None:
        for name in DFLASH2_FIELDS:
            if getattr(self, name) < 1:
                raise ConfigError(f"drafter {name} must be >= 1, got {getattr(self, name)}")
        if self.hidden_size % self.conv_group_size:
            raise ConfigError(
                f"drafter conv_group_size {self.conv_group_size} does not divide hidden_size "
                f"{self.hidden_size}"
            )
        if self.selector_top_k > self.vocab_size:
            raise ConfigError(
                f"drafter selector_top_k {self.selector_top_k} is above the vocabulary size "
                f"{self.vocab_size}"
            )

    @classmethod
    def from_target(
        cls,
        target_config: PretrainedConfig,
        *,
        mask_token_id: int,
        num_layers: int = 5,
        block_size: int = 16,
        target_layer_ids: list[int] | None = None,
        layer_types: list[str] | None = None,
        sliding_window: int | None = None,
        learned_mask_embedding: bool = False,
        **dflash2,
    ) -> DrafterConfig:
        """Size a drafter like the target (any HF causal LM config, multimodal ones included).
        `dflash2`: architecture and the DFLASH2_FIELDS, where not the defaults."""
        tc = target_config.get_text_config()
        heads = tc.num_attention_heads
        return cls(
            hidden_size=tc.hidden_size,
            intermediate_size=tc.intermediate_size,
            num_attention_heads=heads,
            num_key_value_heads=getattr(tc, "num_key_value_heads", None) or heads,
            head_dim=getattr(tc, "head_dim", None) or tc.hidden_size // heads,
            rms_norm_eps=getattr(tc, "rms_norm_eps", None) or 1e-6,
            vocab_size=tc.vocab_size,
            max_position_embeddings=tc.max_position_embeddings,
            rope_parameters=target_rope_parameters(tc),
            num_target_layers=tc.num_hidden_layers,
            mask_token_id=mask_token_id,
            num_layers=num_layers,
            block_size=block_size,
            target_layer_ids=target_layer_ids,
            layer_types=layer_types,
            sliding_window=sliding_window,
            learned_mask_embedding=learned_mask_embedding,
            **dflash2,
        )

    @property
    def sliding_windows(self) -> list[int | None]:
        """Per layer: the window of a sliding_attention layer, None for full attention."""
        return [self.sliding_window if t == "sliding_attention" else None for t in self.layer_types]

    def to_qwen3_config(self) -> Qwen3Config:
        """The same shape as a transformers Qwen3Config (feeds its MLP, norm and RoPE code)."""
        sliding = "sliding_attention" in self.layer_types
        return Qwen3Config(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            hidden_act="silu",
            max_position_embeddings=self.max_position_embeddings,
            rms_norm_eps=self.rms_norm_eps,
            rope_parameters=dict(self.rope_parameters),
            attention_bias=False,
            use_sliding_window=sliding,
            sliding_window=self.sliding_window if sliding else None,
            max_window_layers=self.num_layers,
            layer_types=list(self.layer_types),
            tie_word_embeddings=False,
        )


def target_rope_parameters(text_config: PretrainedConfig) -> dict:
    """The target's RoPE settings (incl. scaling) as one transformers-v5 `rope_parameters` dict."""
    params = getattr(text_config, "rope_parameters", None)
    if params and "rope_type" not in params and "full_attention" in params:
        # Per-layer-type RoPE (e.g. Gemma 3): the drafter has one RoPE; use the global layers' one.
        params = params["full_attention"]
    if not params:
        scaling = getattr(text_config, "rope_scaling", None) or {}
        params = {"rope_type": "default", **scaling, "rope_theta": text_config.rope_theta}
    params = dict(params)
    params.setdefault("rope_type", params.pop("type", "default"))
    return params


class RotaryEmbedding(nn.Module):
    """RoPE cos/sin from transformers' init functions (every scaling variant), kept in float32.

    Only the frequencies at initialization are used: the runtime switches of "dynamic" and
    "longrope" apply beyond the original context length, which drafter training does not reach.
    """

    def __init__(self, config: Qwen3Config):
        super().__init__()
        rope_type = config.rope_parameters["rope_type"]
        if rope_type == "default":
            inv_freq, self.attention_scaling = Qwen3RotaryEmbedding.compute_default_rope_parameters(
                config
            )
        else:
            inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](config)
        self._inv_freq_fp32 = inv_freq.float()  # outside the module state: .to() cannot cast it
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)

    def _apply(self, fn, recurse=True):
        # Module.to(bfloat16) casts buffers too, and bf16 frequencies put the angles off by whole
        # radians at positions in the thousands: restore float32 on whatever device fn chose.
        super()._apply(fn, recurse)
        self.inv_freq = self._inv_freq_fp32.to(self.inv_freq.device)
        return self

    def forward(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        freqs = positions[:, None].float() * self.inv_freq[None, :]  # (S, D/2)
        emb = torch.cat([freqs, freqs], dim=-1)  # (S, D)
        return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x (1, heads, S, D), cos/sin (S, D) -> x rotated by its positions."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    """Qwen3 attention whose keys/values also cover the shared context: queries from the block."""

    def __init__(self, config: DrafterConfig, sliding_window: int | None):
        super().__init__()
        H, D = config.hidden_size, config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = D
        self.sliding_window = sliding_window
        self.q_proj = nn.Linear(H, self.num_heads * D, bias=False)
        self.k_proj = nn.Linear(H, self.num_kv_heads * D, bias=False)
        self.v_proj = nn.Linear(H, self.num_kv_heads * D, bias=False)
        self.o_proj = nn.Linear(self.num_heads * D, H, bias=False)
        self.q_norm = Qwen3RMSNorm(D, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(D, eps=config.rms_norm_eps)

    def forward(
        self, x: Tensor, ctx: Tensor, rope: tuple[Tensor, Tensor], masks: dict[int | None, Mask]
    ) -> Tensor:
        Q, T, D = x.shape[0], ctx.shape[0], self.head_dim
        cos, sin = rope  # (T + Q, D): context positions, then block positions
        kv_in = torch.cat([ctx, x], dim=0)  # (T + Q, H)
        q = self.q_norm(self.q_proj(x).view(Q, self.num_heads, D))  # (Q, Hq, D)
        k = self.k_norm(self.k_proj(kv_in).view(T + Q, self.num_kv_heads, D))  # (T+Q, Hkv, D)
        v = self.v_proj(kv_in).view(T + Q, self.num_kv_heads, D)  # (T+Q, Hkv, D)
        q = apply_rope(q.transpose(0, 1)[None], cos[T:], sin[T:])  # (1, Hq, Q, D)
        k = apply_rope(k.transpose(0, 1)[None], cos, sin)  # (1, Hkv, T+Q, D)
        v = v.transpose(0, 1)[None]  # (1, Hkv, T+Q, D)
        y = attend(q, k, v, masks[self.sliding_window], self.sliding_window)  # (1, Hq, Q, D)
        return self.o_proj(y[0].transpose(0, 1).reshape(Q, self.num_heads * D))  # (Q, H)


class DecoderLayer(nn.Module):
    def __init__(self, config: DrafterConfig, sliding_window: int | None, mlp_config: Qwen3Config):
        super().__init__()
        self.self_attn = Attention(config, sliding_window)
        self.mlp = Qwen3MLP(mlp_config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.dropout = 0.0  # residual dropout while training (train.dropout); not exported
        self.block_size = config.block_size
        self.attention_conv = self.mlp_conv = None  # DFlash2's convolutions (dflash2.DynamicConv)
        if config.dflash2:
            H, K, S = config.hidden_size, config.conv_kernel_size, config.conv_group_size
            self.attention_conv = DynamicConv(H, K, S)
            self.mlp_conv = DynamicConv(H, K, S)

    def forward(
        self, x: Tensor, ctx: Tensor, rope: tuple[Tensor, Tensor], masks: dict[int | None, Mask]
    ) -> Tensor:
        """x (Q, H): whole blocks of block_size slots, one after another."""
        # The context is not re-normalized per layer: it was normalized once by hidden_norm.
        if self.attention_conv is None:
            x = x + self._drop(self.self_attn(self.input_layernorm(x), ctx, rope, masks))
            return x + self._drop(self.mlp(self.post_attention_layernorm(x)))
        blocks = (-1, self.block_size, x.shape[-1])  # the convolutions run per block
        h, dyn = self.attention_conv.before(self.input_layernorm(x).view(blocks))  # (A, B, H)
        h = self.self_attn(h.flatten(0, 1), ctx, rope, masks).view(blocks)
        x = x + self._drop(self.attention_conv.after(h, dyn).flatten(0, 1))
        h, dyn = self.mlp_conv.before(self.post_attention_layernorm(x).view(blocks))
        return x + self._drop(self.mlp_conv.after(self.mlp(h), dyn).flatten(0, 1))

    def _drop(self, h: Tensor) -> Tensor:
        return nn.functional.dropout(h, self.dropout, self.training) if self.dropout else h


def input_embedding_scale(target: nn.Module) -> float:
    """What the target's input embedding multiplies its rows by: sqrt(hidden) for Gemma (its
    scaled embedding module), else 1. Serving engines embed the drafter's block with that same
    module (SGLang: `get_input_embeddings()(block_ids)`), so the drafter trains on what it gets."""
    module = target.get_input_embeddings()
    scale = getattr(module, "scalar_embed_scale", getattr(module, "embed_scale", 1.0))
    return float(scale)


class Drafter(nn.Module):
    """The DFlash drafter over one packed stream; embedding and LM head are the target's, frozen.
    `embed_scale`: the target's input embedding scale (`input_embedding_scale`)."""

    def __init__(self, config: DrafterConfig, embed_weight: Tensor, lm_head_weight: Tensor,
                 embed_scale: float = 1.0):  # fmt: skip
        super().__init__()
        V, H = config.vocab_size, config.hidden_size
        for name, w in (("embed_weight", embed_weight), ("lm_head_weight", lm_head_weight)):
            if tuple(w.shape) != (V, H):
                raise ValueError(f"target {name} has shape {tuple(w.shape)}, expected {(V, H)}")
        self.config = config
        self.embed_tokens = nn.Embedding.from_pretrained(embed_weight, freeze=True)
        self.embed_scale = embed_scale
        self.lm_head = nn.Linear(H, V, bias=False)
        self.lm_head.weight = nn.Parameter(lm_head_weight, requires_grad=False)
        n_taps = len(config.target_layer_ids)
        self.fc = nn.Linear(n_taps * H, H, bias=False)
        self.hidden_norm = Qwen3RMSNorm(H, eps=config.rms_norm_eps)
        qwen3 = config.to_qwen3_config()
        self.layers = nn.ModuleList(DecoderLayer(config, w, qwen3) for w in config.sliding_windows)
        self.norm = Qwen3RMSNorm(H, eps=config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(qwen3)
        if config.learned_mask_embedding:
            # Starts as the target's mask row, so the opt-in changes nothing at step 0.
            row = embed_weight[config.mask_token_id].detach() * embed_scale
            self.mask_embedding = nn.Parameter(row.to(self.fc.weight.dtype))
        if config.dflash2:
            self.candidate_selector = CandidateSelector(
                V, H, config.selector_rank, config.selector_top_k
            )
        self.reset_parameters()

    @classmethod
    def from_target_model(cls, config: DrafterConfig, target: nn.Module) -> Drafter:
        """Take embedding and LM head from a loaded HF target model (shared, not copied)."""
        embed = target.get_input_embeddings().weight.detach()
        head = target.get_output_embeddings()
        return cls(config, embed, (head.weight if head is not None else embed).detach(),
                   input_embedding_scale(target))  # fmt: skip

    def reset_parameters(self) -> None:
        # HF Qwen3 initialization: normal(0, 0.02) linear weights, unit norm weights. DFlash2's
        # modules draw after the backbone, so a seed gives a dflash2 drafter the backbone of the
        # dflash one, and identity convolutions make it that drafter exactly (dflash2.py).
        extra = (DynamicConv, CandidateSelector)
        skip = {id(p) for m in self.modules() if isinstance(m, extra) for p in m.parameters()}
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear) and not name.startswith("lm_head"):
                if id(module.weight) not in skip:
                    nn.init.normal_(module.weight, std=0.02)
            elif isinstance(module, Qwen3RMSNorm):
                nn.init.ones_(module.weight)
        for module in self.modules():
            if isinstance(module, extra):
                module.reset_parameters()

    def trainable_state_dict(self) -> dict[str, Tensor]:
        """The exported weights: everything but the target's frozen embedding and LM head."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith(FROZEN_PREFIXES)}

    def embed_blocks(self, block_ids: Tensor) -> Tensor:
        """(A, B) token ids, slot 0 = x_a, others = mask token -> (A, B, H) block inputs: the
        target's input embedding of them (its scale in its dtype, as HF and SGLang apply it)."""
        x = self.embed_tokens(block_ids)  # (A, B, H)
        if self.embed_scale != 1.0:
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype, device=x.device)
        x = x.to(self.fc.weight.dtype)
        if self.config.learned_mask_embedding:
            is_mask = (torch.arange(block_ids.shape[1], device=x.device) > 0)[None, :, None]
            x = torch.where(is_mask, self.mask_embedding.to(x.dtype), x)
        return x

    def forward(
        self,
        input_ids: Tensor,
        target_hidden: Tensor,
        position_ids: Tensor,
        document_ids: Tensor,
        anchors: Tensor,
        keep: Tensor,
        backend: str | None = None,
    ) -> Tensor:
        """Final hidden states (A, B, H) of every block; logits are `lm_head` of them.

        input_ids, position_ids (per-document positions), document_ids: (T,) over the packed
        stream; target_hidden (T, n_taps*H); anchors (A,) stream indices; keep (A,) bool.
        """
        B = self.config.block_size
        slots = torch.arange(B, device=input_ids.device)
        block_ids = torch.full(
            (anchors.shape[0], B), self.config.mask_token_id, device=slots.device
        )
        block_ids[:, 0] = input_ids[anchors]  # (A, B)
        block_pos = position_ids[anchors][:, None] + slots  # (A, B): slot k at position a+k
        masks = build_masks(
            document_ids, anchors, keep, B, self.config.sliding_windows, backend=backend
        )
        x = self.embed_blocks(block_ids).flatten(0, 1)  # (A*B, H)
        ctx = self.context(target_hidden)  # (T, H)
        rope = self.rotary_emb(torch.cat([position_ids, block_pos.flatten()]))  # (T+A*B, D)
        return self.decode(x, ctx, rope, masks).view(anchors.shape[0], B, -1)  # (A, B, H)

    def context(self, target_hidden: Tensor) -> Tensor:
        """(T, n_taps*H) target states -> (T, H) context shared by every layer (computed once;
        inference appends to it one accepted token at a time)."""
        return self.hidden_norm(self.fc(target_hidden.to(self.fc.weight.dtype)))

    def decode(self, x: Tensor, ctx: Tensor, rope: tuple[Tensor, Tensor], masks: dict) -> Tensor:
        """The layer stack and final norm over block inputs x (Q, H) given the context (T, H)."""
        for layer in self.layers:
            x = layer(x, ctx, rope, masks)
        return self.norm(x)


def init_from_target_layers(drafter: Drafter, target: nn.Module) -> list[int]:
    """Start drafter layer i from target decoder layer N-L+i (the target's last L layers) and the
    final norm from the target's: every weight whose name and shape match is copied. A
    Llama-family target has no per-head q/k norms, so those stay ones; `fc` and `hidden_norm` have
    no counterpart and keep their initialization. Returns the target layers used."""
    decoder = target.get_decoder()
    layers, n = decoder.layers, len(drafter.layers)
    if n > len(layers):
        raise ConfigError(
            f"drafter.init target-layers needs num_layers <= the target's {len(layers)} layers, "
            f"got {n}"
        )
    used = list(range(len(layers) - n, len(layers)))
    with torch.no_grad():
        for mine, j in zip(drafter.layers, used, strict=True):
            theirs = layers[j].state_dict()
            for name, param in mine.state_dict().items():
                src = theirs.get(name)
                if src is not None and src.shape == param.shape:
                    param.copy_(src)
        norm = getattr(decoder, "norm", None)
        if norm is not None and norm.weight.shape == drafter.norm.weight.shape:
            drafter.norm.weight.copy_(norm.weight)
    return used
