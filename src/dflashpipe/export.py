"""Export and load a drafter in the layout of the published DFlash and DFlash2 checkpoints.

    <dir>/config.json        architectures ["DFlashDraftModel"] (dflash2: ["DFlash2DraftModel"]),
                             model_type "qwen3", block_size, num_target_layers,
                             dflash_config {mask_token_id, target_layer_ids, block_size; dflash2:
                             conv_kernel_size, conv_group_size, selector_rank, selector_top_k;
                             input_embedding_scale where not 1}, layer_types, sliding_window,
                             the Qwen3 sizes and RoPE fields
    <dir>/model.safetensors  layers.{i}.self_attn.{q,k,v,o}_proj.weight, ..., fc.weight,
                             hidden_norm.weight, norm.weight (+ mask_embedding when learned);
                             dflash2: layers.{i}.{attention,mlp}_conv.base_kernel (2, K, H) and
                             .kernel_projection.weight (2*K*H/group, H), candidate_selector.
                             {predecessor,successor}_codebook (V, R) bare, .hidden_projection.weight
    <dir>/mask_embedding.pt  a learned mask embedding again, where SGLang and vLLM read it:
                             torch.save({"embedding": (H,) tensor, "mask_token_id": int})

The target's embedding and LM head are not in the file: loaders take them from the target.
Every file is written atomically, config.json last, so a complete config.json means a complete
export.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file, save_file
from torch import Tensor

from dflashpipe.errors import DataError
from dflashpipe.model import DFLASH2_FIELDS, FROZEN_PREFIXES, Drafter, DrafterConfig
from dflashpipe.storage import atomic_path, write_json

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
MASK_EMBEDDING_NAME = "mask_embedding.pt"
ARCHITECTURE = "DFlashDraftModel"
ARCHITECTURES = {"dflash": ARCHITECTURE, "dflash2": "DFlash2DraftModel"}  # config -> config.json


def config_to_dict(config: DrafterConfig, dtype: torch.dtype, embed_scale: float = 1.0) -> dict:
    """config.json of the published drafters; readable as a transformers Qwen3Config too.
    `embed_scale`: the target's input embedding scale (model.input_embedding_scale)."""
    rope = dict(config.rope_parameters)
    dflash = {"mask_token_id": config.mask_token_id, "target_layer_ids": config.target_layer_ids}
    dflash["block_size"] = config.block_size  # newer loaders read it here, older at the top level
    if config.learned_mask_embedding:
        dflash["learned_mask_embedding"] = True
    if config.dflash2:
        dflash |= {name: getattr(config, name) for name in DFLASH2_FIELDS}
    if embed_scale != 1.0:
        # The official loop embeds the block with the raw embedding rows times this (default 1),
        # where engines call the target's embedding module, which scales (Gemma: sqrt(H)).
        dflash["input_embedding_scale"] = embed_scale
    dtype_name = str(dtype).removeprefix("torch.")
    return {
        "architectures": [ARCHITECTURES[config.architecture]],
        "model_type": "qwen3",
        "block_size": config.block_size,
        "num_target_layers": config.num_target_layers,
        "dflash_config": dflash,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "rms_norm_eps": config.rms_norm_eps,
        "vocab_size": config.vocab_size,
        "max_position_embeddings": config.max_position_embeddings,
        "layer_types": config.layer_types,
        "sliding_window": config.sliding_window,
        "use_sliding_window": "sliding_attention" in config.layer_types,
        "max_window_layers": config.num_layers,
        "tie_word_embeddings": False,
        # transformers >= 5 reads rope_parameters; loaders built on 4.x read rope_theta/scaling.
        "rope_parameters": rope,
        "rope_theta": rope["rope_theta"],
        "rope_scaling": None if rope.get("rope_type", "default") == "default" else rope,
        "torch_dtype": dtype_name,
        "dtype": dtype_name,
        "transformers_version": transformers.__version__,
    }


def config_from_dict(d: dict, origin: str = CONFIG_NAME) -> DrafterConfig:
    """Inverse of `config_to_dict`; accepts the published checkpoints' variants as well."""
    known = [a for a, name in ARCHITECTURES.items() if name in (d.get("architectures") or [])]
    if len(known) != 1:
        raise DataError(
            f"{origin}: architectures {d.get('architectures')} lack "
            f"{' or '.join(ARCHITECTURES.values())} (expected exactly one)"
        )
    dflash = d.get("dflash_config") or {}
    try:
        dflash2 = {name: dflash[name] for name in DFLASH2_FIELDS} if known[0] == "dflash2" else {}
        rope = d.get("rope_parameters") or {
            "rope_type": "default",
            **(d.get("rope_scaling") or {}),
            "rope_theta": d["rope_theta"],
        }
        return DrafterConfig(
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_attention_heads=d["num_attention_heads"],
            num_key_value_heads=d["num_key_value_heads"],
            head_dim=d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"],
            rms_norm_eps=d["rms_norm_eps"],
            vocab_size=d["vocab_size"],
            max_position_embeddings=d["max_position_embeddings"],
            rope_parameters=rope,
            num_target_layers=d["num_target_layers"],
            mask_token_id=dflash["mask_token_id"],
            num_layers=d["num_hidden_layers"],
            block_size=d.get("block_size") or dflash["block_size"],
            target_layer_ids=dflash.get("target_layer_ids"),
            layer_types=d.get("layer_types"),
            sliding_window=d.get("sliding_window"),
            learned_mask_embedding=bool(dflash.get("learned_mask_embedding", False)),
            architecture=known[0],
            **dflash2,
        )
    except KeyError as e:
        raise DataError(f"{origin}: missing key {e.args[0]!r} of a DFlash drafter config") from None


def save_drafter(drafter: Drafter, out_dir: str | Path, dtype: torch.dtype | None = None,
                 tensors: dict[str, Tensor] | None = None) -> Path:  # fmt: skip
    """Write config.json + model.safetensors into out_dir; dtype defaults to the weights' own.
    `tensors`: the trainable weights when the drafter's own are sharded (FSDP)."""
    out_dir = Path(out_dir)
    tensors = drafter.trainable_state_dict() if tensors is None else tensors
    dtype = dtype or next(iter(tensors.values())).dtype
    # safetensors refuses shared or strided storage, so every tensor gets its own copy.
    tensors = {k: v.detach().to("cpu", dtype).contiguous().clone() for k, v in tensors.items()}
    with atomic_path(out_dir / WEIGHTS_NAME) as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
    save_mask_embedding(out_dir, drafter.config, tensors.get("mask_embedding"))
    write_json(out_dir / CONFIG_NAME, config_to_dict(drafter.config, dtype, drafter.embed_scale))
    return out_dir


def save_mask_embedding(out_dir: Path, config: DrafterConfig, embedding: Tensor | None) -> None:
    """Write a learned mask embedding as mask_embedding.pt, or remove one an earlier export left
    (served, it would replace the target's mask row the drafter was trained on).

    The layout is the one the engines read (checked in their sources): vLLM's
    vllm/model_executor/models/qwen3_dflash.py (DFlashQwen3ForCausalLM._read_mask_embedding)
    torch.loads it with weights_only=True, compares "mask_token_id" with
    dflash_config.mask_token_id and reshapes "embedding" to (hidden_size,), and drops a
    mask_embedding tensor of model.safetensors when the file is absent; SGLang's
    python/sglang/srt/speculative/dflash_worker_v2.py (DFlashWorkerV2.
    _maybe_merge_trained_mask_embedding, in the versions that have it) requires the same two
    keys and copies "embedding" into the target's embedding row mask_token_id, so it must be a
    flat (hidden_size,) vector; its draft model's load_weights skips names it does not know."""
    path = out_dir / MASK_EMBEDDING_NAME
    if embedding is None:
        path.unlink(missing_ok=True)
        return
    state = {"embedding": embedding.reshape(config.hidden_size),
             "mask_token_id": int(config.mask_token_id)}  # fmt: skip
    with atomic_path(path) as tmp:
        torch.save(state, tmp)


def load_drafter(
    path: str | Path,
    embed_weight: Tensor,
    lm_head_weight: Tensor,
    device: torch.device | str | None = None,
    embed_scale: float = 1.0,
) -> Drafter:
    """Rebuild an exported drafter around the target's embedding (and its scale:
    model.input_embedding_scale) and LM head, in the saved dtype."""
    path = Path(path)
    config_file, weights_file = path / CONFIG_NAME, path / WEIGHTS_NAME
    for f in (config_file, weights_file):
        if not f.is_file():
            raise DataError(
                f"{f} is missing; expected a drafter export ({CONFIG_NAME} + {WEIGHTS_NAME})"
            )
    config = config_from_dict(json.loads(config_file.read_text(encoding="utf-8")), str(config_file))
    tensors = load_file(str(weights_file), device=str(device or "cpu"))
    drafter = Drafter(config, embed_weight, lm_head_weight, embed_scale)
    drafter.to(device=device, dtype=next(iter(tensors.values())).dtype)
    missing, unexpected = drafter.load_state_dict(tensors, strict=False)
    missing = [k for k in missing if not k.startswith(FROZEN_PREFIXES)]
    if missing or unexpected:
        raise DataError(
            f"{weights_file}: tensors do not match the {ARCHITECTURES[config.architecture]} of "
            f"{config_file}: missing weights {missing}, unexpected weights {unexpected}"
        )
    return drafter
