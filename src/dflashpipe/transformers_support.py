"""What the installed transformers can run of a target family (its model type), and the
attention `target.attn_implementation: auto` picks for it.

    model type (config.json's model_type, or a GGUF's general.architecture as transformers
    renames it) ─► Family: its causal-LM class, the attention implementations that class
    accepts (eager always; sdpa, flash_attention_2, flex_attention by its _supports_* flags),
    the cache kinds of its layers (from its default config)
      ─► check_runnable: refused where neither the engine nor the eager loop can decode it
         (no causal LM in transformers; layers with a recurrent state, which speculative
         decoding cannot roll back to the accepted tokens)
      ─► resolve_attention: auto -> sdpa where the class has SDPA, else eager; an explicit
         choice the class refuses -> ConfigError naming the key and the ones it has

These are facts of the installed transformers release, found by importing the family's class
(about 4 s: it imports torch); the checks before any job run on every `snakemake` start, so the
facts are kept per release in $DFLASHPIPE_CACHE/families/ and read back in milliseconds.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from functools import cache
from importlib.metadata import version

from dflashpipe import storage
from dflashpipe.errors import ConfigError

log = logging.getLogger(__name__)

# The config's names of transformers' attention implementations, and the class flags that say
# whether a family takes them (hf_sdpa is transformers' own SDPA, sdpa our folded one on it).
FLAGS = {"sdpa": "_supports_sdpa", "flash_attention_2": "_supports_flash_attn",
         "flash_attention_3": "_supports_flash_attn", "flex_attention": "_supports_flex_attn"}  # fmt: skip
CONFIG_NAMES = {"hf_sdpa": "sdpa"}  # config name -> transformers' name, where they differ
# Layer (cache) kinds that hold keys and values only: a DynamicCache cropped to the accepted
# tokens is the state after them ("dummy": layers that keep nothing, e.g. shared KV).
KV_KINDS = {"full_attention", "sliding_attention", "chunked_attention", "dummy"}
# A GGUF's general.architecture where transformers names the family otherwise
# (modeling_gguf_pytorch_utils.load_gguf_checkpoint).
GGUF_ARCHITECTURES = {"gemma3": "gemma3_text", "gemma4": "gemma4_text", "qwen2moe": "qwen2_moe",
                      "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss", "minimax-m2": "minimax_m2"}  # fmt: skip


@dataclass(frozen=True)
class Family:
    model_type: str
    known: bool  # transformers has a config class for it
    causal_lm: str | None  # its AutoModelForCausalLM class name
    attention: tuple[str, ...]  # transformers' names of the implementations the class takes
    layer_kinds: tuple[str, ...]  # cache kinds of its default config's layers


def gguf_family(architecture: str) -> str:
    """The model type transformers gives a GGUF's general.architecture."""
    return GGUF_ARCHITECTURES.get(architecture, architecture)


def transformers_version() -> str:
    return version("transformers")


def family(model_type: str) -> Family:
    """The facts of `model_type` (see the module docstring), from the cache where it has them."""
    return _family(model_type, transformers_version())


@cache
def _family(model_type: str, release: str) -> Family:
    path = storage.CACHE_DIR / "families" / f"transformers-{release}.json"
    try:
        known = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        known = {}
    if model_type in known:
        return Family(**{k: tuple(v) if isinstance(v, list) else v
                         for k, v in known[model_type].items()})  # fmt: skip
    found = _inspect(model_type)
    try:  # another process may have added a family meanwhile: merge, last writer wins
        with storage.atomic_path(path) as tmp:
            tmp.write_text(json.dumps(known | {model_type: asdict(found)}, indent=1))
    except OSError as e:  # no room or no write access: the facts are found again next time
        log.warning("cannot write %s (%s)", path, e)
    return found


def _inspect(model_type: str) -> Family:
    """The facts, found by importing the family's causal-LM class and default config."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type not in CONFIG_MAPPING:
        return Family(model_type, False, None, (), ())
    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    cls = getattr(transformers, name, None) if name else None
    attention = ("eager", *(impl for impl, flag in FLAGS.items() if getattr(cls, flag, False)))
    try:
        config = CONFIG_MAPPING[model_type]().get_text_config(decoder=True)
    except Exception:  # a config class that needs arguments: its layers are not known here
        return Family(model_type, True, name if cls else None, attention, ())
    kinds = getattr(config, "layer_types", None) or [
        "sliding_attention" if getattr(config, "sliding_window", None) else "full_attention"
    ]
    return Family(model_type, True, name if cls else None, attention, tuple(sorted(set(kinds))))


def check_runnable(fam: Family, target: str, layer_kinds: list[str] | None = None) -> None:
    """Refuse a family neither the engine nor the eager loop can decode, naming it
    (`layer_kinds`: the target's own config's, where known; else the family's defaults)."""
    release = f"transformers {transformers_version()}"
    if not fam.known or fam.causal_lm is None:
        what = "knows no model type" if not fam.known else "has no causal language model for"
        raise ConfigError(
            f"target {target}: {release} {what} {fam.model_type!r}, so neither the decoding "
            "engine nor the eager loop can run it (both decode an AutoModelForCausalLM); "
            "expected a decoder-only language model family transformers supports"
        )
    recurrent = sorted(set(layer_kinds or fam.layer_kinds) - KV_KINDS)
    if recurrent:
        raise ConfigError(
            f"target {target}: the {fam.model_type} family ({fam.causal_lm}) has layers of kind "
            f"{recurrent}, which keep a recurrent state that a KV cache cropped to the accepted "
            "tokens cannot roll back, so neither the decoding engine nor the eager loop can run "
            f"it; expected attention layers only ({sorted(KV_KINDS - {'dummy'})})"
        )


def resolve_attention(choice: str, fam: Family) -> str:
    """target.attn_implementation for a target of this family, as the config names it: auto ->
    sdpa where the family has SDPA attention, else eager; an explicit choice it refuses ->
    ConfigError naming the key and the family's alternatives; names it cannot judge (a kernel
    from the hub) as given."""
    if choice == "auto":
        return "sdpa" if "sdpa" in fam.attention else "eager"
    wanted = CONFIG_NAMES.get(choice, choice)
    if fam.causal_lm is None or (wanted != "eager" and wanted not in FLAGS):
        return choice
    if wanted not in fam.attention:
        has = [name for name in dict.fromkeys(("sdpa", "hf_sdpa", *FLAGS))
               if CONFIG_NAMES.get(name, name) in fam.attention]  # fmt: skip
        raise ConfigError(
            f"target.attn_implementation {choice!r}: the {fam.model_type} family "
            f"({fam.causal_lm}) has no {wanted} attention in transformers "
            f"{transformers_version()}; expected auto (here: "
            f"{resolve_attention('auto', fam)}), eager{''.join(f', {n}' for n in has)}"
        )
    return choice
