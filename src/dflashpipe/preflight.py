"""Checks of a config that run before any job: when the workflow starts (common.smk), in
`python -m dflashpipe check-config`, and again as the stages that load the target start
(regenerate, extract), for a target that was not on disk yet when the workflow started.

    config ─► every file it names on disk or made by a `retrieve:` entry (prompt sources,
              prompts.exclude, train.extra_features, a local target, its GGUF or tokenizer):
              a missing one is refused before any job can remove an output
           ─► config-only checks (drafter.sliding_window against train.max_length and the
              drafter's layers; target.chat_template a template, a file, auto or none; a
              train.loss that needs the target's distribution against what extract stores;
              train.selector and train.parallel against drafter.architecture)
    target ─► its shape (decoder layers, vocabulary, family, whether it has a chat template),
              read cheaply where it is local: a HF directory's config.json and tokenizer
              files, a GGUF file's metadata header (the tensors are not read), a hub id's files
              in the local HF cache; None otherwise
           ─► taps inside the target and not on its last layer (layout.check_taps),
              extract.topk, drafter.mask_token_id and drafter.selector_top_k inside its
              vocabulary, drafter.conv_group_size dividing its hidden size
           ─► its family runnable (transformers_support.check_runnable) and target.attn_implementation one
              the family has (transformers_support.resolve_attention)
           ─► plain-text prompts (no chat template) with conversation sources only under
              prompts.max_turns: 1

Reading the SmolLM2 GGUF's shape takes milliseconds (Gemma 3's, with its 262,144 tokens, 40 ms);
gguf's GGUFReader takes 3.3 s on it (it parses every field, the 49,152-token vocabulary and the
merges included) and target.load_target_config 15-40 s on a machine's first run (it converts the
whole GGUF), so neither suits a check that runs on every `snakemake` call.
"""

from __future__ import annotations

import json
import mmap
import struct
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING

from dflashpipe import transformers_support
from dflashpipe.chat import template_text
from dflashpipe.config import is_local_path
from dflashpipe.errors import ConfigError
from dflashpipe.layout import check_taps, default_target_layer_ids

if TYPE_CHECKING:
    from dflashpipe.config import Config, TargetConfig

LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers")  # HF config.json spellings
HIDDEN_KEYS = ("hidden_size", "n_embd", "d_model")
TOKENIZER_FILES = ("tokenizer_config.json", "chat_template.jinja", "chat_template.json")
# Sources whose prompts can carry history; humaneval and python give one user message each.
CONVERSATION_KINDS = ("sharegpt", "jsonl", "parquet", "hf")


@dataclass(frozen=True)
class TargetShape:
    """What the checks need of a target; `name` is the target as messages name it; `family`
    its model type, `chat_template` whether its tokenizer has one and `layer_types` its
    config's, each None where not known cheaply."""

    num_layers: int
    vocab_size: int
    name: str
    family: str | None = None
    chat_template: bool | None = None
    layer_types: tuple[str, ...] | None = None
    hidden_size: int | None = None

    @classmethod
    def of(cls, hf_config, name: str) -> TargetShape:
        """From a loaded transformers config (multimodal ones: their text model)."""
        text = hf_config.get_text_config()
        kinds = getattr(text, "layer_types", None)
        return cls(text.num_hidden_layers, text.vocab_size, name, hf_config.model_type, None,
                   tuple(kinds) if kinds else None, text.hidden_size)  # fmt: skip


def target_name(target: TargetConfig) -> str:
    return target.model + (f"/{target.gguf_file}" if target.gguf_file else "")


def check_config(cfg: Config) -> None:
    """Checks across sections that need no target."""
    if cfg.target.chat_template not in (None, "auto", "none"):
        template_text(cfg.target.chat_template)  # Jinja text or an existing file
    check_loss_inputs(cfg)
    check_architecture(cfg)
    drafter, window = cfg.drafter, cfg.drafter.sliding_window
    if window is None:
        return
    max_length = cfg.train.max_length
    if window > max_length:
        raise ConfigError(
            f"drafter.sliding_window {window} is larger than train.max_length {max_length}: "
            "no training sequence is long enough for the window to cut anything, so the drafter "
            "would train as full attention and be served with a window it never saw; expected "
            f"at most {max_length}, or null for full attention"
        )
    if drafter.num_layers < 2:
        raise ConfigError(
            f"drafter.sliding_window {window} with drafter.num_layers {drafter.num_layers}: "
            "the window applies to every drafter layer but the last, which keeps full "
            "attention, so a one-layer drafter would not use it; expected num_layers >= 2, or "
            "sliding_window null"
        )


def check_loss_inputs(cfg: Config) -> None:
    """A train.loss that needs the target's distribution (objective forward_kl, labels greedy)
    needs features that hold it: extract.final_hidden (its whole distribution) or extract.topk
    (its top-k). Refused here, before regenerate and extract spend hours on features the loss
    cannot use (train refuses such a manifest too: features.target_source)."""
    ex, needs = cfg.extract, cfg.train.loss.needs_target()
    if needs and not (ex.final_hidden or ex.topk):
        raise ConfigError(
            f"{', '.join(needs)} trains on the target's distribution, which the features would "
            f"not hold (extract.final_hidden {'on' if ex.final_hidden else 'off'}, extract.topk "
            f"{ex.topk}); set extract.final_hidden true (its whole distribution) or "
            "extract.topk > 0 (its top-k)"
        )


def check_architecture(cfg: Config) -> None:
    """train.selector trains a DFlash2 drafter's selector and evaluate.selector turns it off in
    decoding: refused on a dflash drafter (the
    drafter section's own keys are refused in config.DrafterShape). FSDP2 is refused with
    dflash2: the selector's loss reads its parameters outside the drafter's forward, where
    FSDP2 would hand it shards."""
    architecture = cfg.drafter.architecture
    if architecture != "dflash2" and cfg.train.selector is not None:
        raise ConfigError(
            f"train.selector is set with drafter.architecture {architecture}: it weighs the "
            "DFlash2 selector's loss, and a dflash drafter has no selector; set "
            "drafter.architecture: dflash2, or leave train.selector out"
        )
    if architecture != "dflash2" and cfg.evaluate.selector is not None:
        raise ConfigError(
            f"evaluate.selector is set with drafter.architecture {architecture}: it turns a "
            "DFlash2 drafter's selector on or off in decoding, and a dflash drafter has no "
            "selector; set drafter.architecture: dflash2, or leave evaluate.selector out"
        )
    if architecture == "dflash2" and cfg.train.parallel == "fsdp":
        raise ConfigError(
            "train.parallel fsdp with drafter.architecture dflash2: the selector's loss runs "
            "outside the drafter's forward, where FSDP2 would give it sharded parameters; set "
            "train.parallel: ddp"
        )


def check_dflash2_sizes(cfg: Config, hidden_size: int | None, vocab: int, name: str) -> None:
    """drafter.conv_group_size divides the target's hidden size and drafter.selector_top_k is
    within its vocabulary (set or at DrafterConfig's defaults), named before any job runs."""
    if cfg.drafter.architecture != "dflash2":
        return
    from dflashpipe.model import DrafterConfig  # torch: only for a dflash2 drafter

    sizes = {f.name: f.default for f in fields(DrafterConfig)} | cfg.drafter.dflash2_sizes()
    group, top_k = sizes["conv_group_size"], sizes["selector_top_k"]
    unset = {k: "" if k in cfg.drafter.dflash2_sizes() else " (unset: the default)"
             for k in ("conv_group_size", "selector_top_k")}  # fmt: skip
    if hidden_size and hidden_size % group:
        raise ConfigError(
            f"drafter.conv_group_size {group}{unset['conv_group_size']} does not divide the "
            f"hidden size {hidden_size} of target {name}; expected a divisor of {hidden_size}"
        )
    if top_k > vocab:
        raise ConfigError(
            f"drafter.selector_top_k {top_k}{unset['selector_top_k']} is above the vocabulary "
            f"of target {name} ({vocab} tokens); expected at most {vocab}"
        )


def check_fits_target(cfg: Config, shape: TargetShape) -> None:
    """The target's family (runnable, with the configured attention), the config's taps,
    extract.topk, drafter.mask_token_id and prompt format against the target's shape."""
    if shape.family is not None:
        family = transformers_support.family(shape.family)
        transformers_support.check_runnable(family, shape.name, shape.layer_types)
        transformers_support.resolve_attention(cfg.target.attn_implementation, family)
    drafter = cfg.drafter
    ids, key = drafter.target_layer_ids, "drafter.target_layer_ids"
    if ids is None:
        n = drafter.num_target_layers
        ids = default_target_layer_ids(shape.num_layers, n)
        key = f"drafter.target_layer_ids (null: the default taps for drafter.num_target_layers {n})"
    check_taps(ids, shape.num_layers, key, shape.name)
    vocab, k = shape.vocab_size, cfg.extract.topk
    if k > vocab:
        raise ConfigError(
            f"extract.topk {k} is larger than the vocabulary of target {shape.name} "
            f"({vocab} tokens); expected at most {vocab}, or 0 for no soft targets"
        )
    mask = drafter.mask_token_id
    if mask is not None and mask >= vocab:
        raise ConfigError(
            f"drafter.mask_token_id {mask} is outside the vocabulary of target {shape.name} "
            f"({vocab} tokens); expected an id below {vocab}, or null to choose one"
        )
    check_prompt_format(cfg, shape)
    check_dflash2_sizes(cfg, shape.hidden_size, vocab, shape.name)
    if shape.hidden_size and cfg.extract.group_size is not None:  # before regenerate's GPU hours
        from dflashpipe.codecs import check_group  # torch: only where a group size is set

        check_group(cfg.extract.group_size, shape.hidden_size)


def check_prompt_format(cfg: Config, shape: TargetShape) -> None:
    """A target read as plain text (no chat template: chat.py) takes one user message per
    prompt: conversation sources are refused unless prompts.max_turns keeps single turns."""
    choice = cfg.target.chat_template
    plain = choice == "none" or (choice in (None, "auto") and shape.chat_template is False)
    conversations = [s.name for s in cfg.prompts.sources if s.kind in CONVERSATION_KINDS]
    if plain and conversations and cfg.prompts.max_turns != 1:
        why = "target.chat_template is none" if choice == "none" else "its tokenizer has none"
        raise ConfigError(
            f"target {shape.name} reads prompts as plain text ({why}: a base model continues "
            f"one user message's text), but prompts.sources {conversations} are conversations "
            "whose prompts can carry several turns; set target.chat_template to a chat template "
            "(Jinja text or a file) to render them, or prompts.max_turns: 1 to keep "
            "single-turn prompts only"
        )


def named_files(cfg: Config) -> list[tuple[str, str]]:
    """(key, path) of every local file or directory the config names: prompt sources, excludes,
    extra feature manifests, and the target, its GGUF and its tokenizer where they are paths
    rather than hub ids."""
    files = [(f"prompts.sources[{i}] '{s.name}' path", s.file)
             for i, s in enumerate(cfg.prompts.sources) if s.file]  # fmt: skip
    files += [(f"prompts.exclude[{i}]", p) for i, p in enumerate(cfg.prompts.exclude)]
    files += [(f"train.extra_features[{i}]", p) for i, p in enumerate(cfg.train.extra_features)]
    target = cfg.target
    if is_local_path(target.model):
        files.append(("target.model", target.model))
        if target.gguf_file:
            files.append(("target.gguf_file", str(Path(target.model) / target.gguf_file)))
    if target.tokenizer and is_local_path(target.tokenizer):
        files.append(("target.tokenizer", target.tokenizer))
    return files


def check_files(cfg: Config) -> None:
    """Every file the config names exists or is made by one of its `retrieve:` entries: a
    missing one would otherwise be read as a hub id, or leave the old results in place
    ("Nothing to be done"), or fail a job after Snakemake removed its outputs."""
    made = [Path(spec.dest) for spec in cfg.retrieve.values()]
    missing = [
        (key, path)
        for key, path in named_files(cfg)
        if not Path(path).expanduser().exists()
        and not any(d == Path(path) or Path(path) in d.parents for d in made)
    ]
    if missing:
        lines = "\n  ".join(f"{key}: {path} does not exist" for key, path in missing)
        raise ConfigError(
            f"names files that are not there (relative paths are read from {Path.cwd()}):\n"
            f"  {lines}\nexpected existing files, or a `retrieve:` entry whose dest makes them"
        )


def check_against_target(cfg: Config) -> None:
    """Every check that can run now: the files the config names, the config's own, and the
    target's where it is local (skipped otherwise: the stages that load the target check at
    their start)."""
    check_files(cfg)
    check_config(cfg)
    shape = read_target_shape(cfg.target)
    if shape is not None:
        check_fits_target(cfg, shape)


def check_workflow_config(raw: dict, origin: str) -> Config:
    """The config a workflow run or check-config goes on with: validated and checked as far as
    it can be before any job, every error naming `origin` (the config file or files)."""
    from dflashpipe.config import Config

    cfg = Config.from_dict(raw, origin=origin)  # its errors start with the origin
    try:
        check_against_target(cfg)
    except ConfigError as e:
        raise ConfigError(f"{origin}: {e}") from None
    return cfg


def check_before_loading(cfg: Config) -> None:
    """At the start of a stage that loads the target: every check, reading the target's
    transformers config where its shape cannot be read cheaply (a hub id not cached yet)."""
    check_config(cfg)
    shape = read_target_shape(cfg.target)
    if shape is None:
        from dflashpipe.target import load_target_config

        shape = TargetShape.of(load_target_config(cfg.target), target_name(cfg.target))
    if shape.chat_template is None:
        from dflashpipe.target import load_tokenizer

        tok = load_tokenizer(replace(cfg.target, chat_template=None))  # its own template
        shape = replace(shape, chat_template=tok.chat_template is not None)
    check_fits_target(cfg, shape)


def read_target_shape(target: TargetConfig) -> TargetShape | None:
    """The target's shape from local files alone; None where they are not there yet or do not
    say (the stage that loads the target then checks, with its own messages)."""
    path = _local_file(target)
    if path is None:
        return None
    try:
        if target.gguf_file:
            return TargetShape(*_gguf_shape(path, target_name(target)))
        return _hf_shape(path, target_name(target), target.tokenizer)
    except (OSError, ValueError, KeyError, TypeError, StopIteration, struct.error):
        return None


def _local_file(target: TargetConfig) -> Path | None:
    """The GGUF file or config.json that holds the target's shape, if it is on this machine."""
    wanted = target.gguf_file or "config.json"
    root = Path(target.model).expanduser()
    if root.exists():
        path = root / wanted if root.is_dir() else root
        return path if path.is_file() else None
    if is_local_path(target.model):
        return None  # a local path not made yet (`snakemake resources` retrieves it)
    try:  # a hub id: only what the local HF cache already holds, never the network
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(target.model, wanted, revision=target.revision)
    except (ImportError, ValueError):  # not a repo id after all
        return None
    return Path(found) if isinstance(found, str) else None


def _hf_shape(config_json: Path, name: str, tokenizer: str | None) -> TargetShape:
    top = json.loads(config_json.read_text(encoding="utf-8"))
    text = top.get("text_config") or {}
    layers = next(d[k] for d in (text, top) for k in LAYER_KEYS if d.get(k) is not None)
    vocab = next(d["vocab_size"] for d in (text, top) if d.get("vocab_size") is not None)
    kinds = text.get("layer_types") or top.get("layer_types")
    # the tokenizer's files beside the config (a separate target.tokenizer: not known here)
    template = None if tokenizer else _has_template(config_json.parent)
    hidden = next((d[k] for d in (text, top) for k in HIDDEN_KEYS if d.get(k) is not None), None)
    return TargetShape(int(layers), int(vocab), name, top.get("model_type"), template,
                       tuple(kinds) if kinds else None, hidden and int(hidden))  # fmt: skip


def _has_template(root: Path) -> bool | None:
    """Whether a local HF tokenizer has a chat template (None: no tokenizer files there)."""
    if not (root / TOKENIZER_FILES[0]).is_file():
        return None
    if any((root / f).is_file() for f in TOKENIZER_FILES[1:]):
        return True
    return bool(json.loads((root / TOKENIZER_FILES[0]).read_text()).get("chat_template"))


def _gguf_shape(path: Path, name: str) -> tuple:
    """TargetShape's fields (block_count, vocabulary, name, family, has a chat template, no
    layer types, embedding_length) from a GGUF's metadata: the
    key/value section is walked; arrays are skipped by their lengths (strings one by one),
    nothing but the few keys needed is decoded."""
    from gguf import GGUF_MAGIC, GGUFValueType

    scalar = {GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H",
              GGUFValueType.INT16: "h", GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i",
              GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?", GGUFValueType.UINT64: "Q",
              GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d"}  # fmt: skip
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        magic, version, _, n_kv = struct.unpack_from("<IIQQ", m, 0)
        if magic != GGUF_MAGIC or version < 2:
            raise ValueError(f"{path}: not a little-endian GGUF v2+ file")
        pos, found = 24, {}

        def string(pos: int) -> tuple[str, int]:
            (n,) = struct.unpack_from("<Q", m, pos)
            return bytes(m[pos + 8 : pos + 8 + n]).decode("utf-8"), pos + 8 + n

        def skip(pos: int, kind: int) -> int:
            if kind == GGUFValueType.STRING:
                return pos + 8 + struct.unpack_from("<Q", m, pos)[0]
            if kind == GGUFValueType.ARRAY:
                item, count = struct.unpack_from("<IQ", m, pos)
                pos += 12
                if item in scalar:
                    return pos + count * struct.calcsize(scalar[item])
                for _ in range(count):
                    pos = skip(pos, item)
                return pos
            return pos + struct.calcsize(scalar[kind])

        for _ in range(n_kv):
            key, pos = string(pos)
            (kind,) = struct.unpack_from("<I", m, pos)
            pos += 4
            if key == "general.architecture":
                found["arch"], pos = string(pos)
            elif (
                key.endswith((".block_count", ".vocab_size", ".embedding_length"))
                and kind in scalar
            ):
                found[key] = struct.unpack_from("<" + scalar[kind], m, pos)[0]
                pos += struct.calcsize(scalar[kind])
            elif key == "tokenizer.ggml.tokens" and kind == GGUFValueType.ARRAY:
                found["tokens"] = struct.unpack_from("<IQ", m, pos)[1]
                pos = skip(pos, kind)
            else:
                found[key] = True  # present (tokenizer.chat_template is all that is asked)
                pos = skip(pos, kind)
    arch = found.get("arch")
    layers = found.get(f"{arch}.block_count")
    vocab = found.get(f"{arch}.vocab_size") or found.get("tokens")
    if not (arch and layers and vocab):
        raise KeyError(f"{path}: no architecture, block_count or vocabulary in the GGUF metadata")
    template = "tokenizer.chat_template" in found
    hidden = found.get(f"{arch}.embedding_length")
    family = transformers_support.gguf_family(arch)
    return int(layers), int(vocab), name, family, template, None, hidden and int(hidden)
