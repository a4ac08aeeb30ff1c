"""The one target loader for every stage (regenerate, extract, evaluate) and its identity.

A target is an HF hub id, a local HF directory, or a GGUF file inside a directory
(`gguf_file=`). The identity (name, weights hash, tokenizer hash, chat-template hash, and how it
runs: the attention `target.attn_implementation` resolved to, chat or plain-text prompts) goes
into every output's metadata so a consumer can refuse data made by another target.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import safetensors.torch
import torch

from dflashpipe import attention, gguf_tokenizer, storage, transformers_support
from dflashpipe.chat import apply_template_choice, prompt_format
from dflashpipe.config import TargetConfig, is_local_path
from dflashpipe.errors import DataError

log = logging.getLogger(__name__)

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt")
# what gguf_cache's directories hold, as a version in their names: a new one converts again
# (2: tokenizers checked, gguf_tokenizer.py; version 1's Gemma tokenizers from transformers 5.17
# split every character)
CONVERSION = 2


@dataclass(frozen=True)
class TargetIdentity:
    name: str
    weights_sha256: str
    tokenizer_sha256: str
    chat_template_sha256: str
    attn_implementation: str  # target.attn_implementation as resolved (auto: by the family)
    prompt_format: str  # chat.CHAT or chat.PLAIN (no template: prompts are plain text)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


def _is_local(cfg: TargetConfig) -> bool:
    """True for a local directory/file; a missing path that is clearly not a hub id is an error."""
    if Path(cfg.model).expanduser().exists():
        return True
    if is_local_path(cfg.model):
        raise DataError(f"target.model {cfg.model!r} does not exist{_fetch_hint(cfg.model)}")
    return False


def _fetch_hint(path: str | Path) -> str:
    """What to do about a missing local target file: fetch it where a `retrieve:` entry makes
    it (resources/), else name what was expected."""
    if str(path).startswith("resources/"):
        return " (`snakemake resources` fetches what the config's retrieve: entries name)"
    return "; expected a local HF directory or GGUF file there, or a hub id (org/name)"


def _hub_kwargs(cfg: TargetConfig, local: bool) -> dict:
    kwargs = {"revision": cfg.revision} if cfg.revision else {}
    if local:
        # A local target must never reach for a hub (offline machines would retry for minutes).
        kwargs["local_files_only"] = True
    if cfg.gguf_file:
        kwargs["gguf_file"] = cfg.gguf_file
    return kwargs


def torch_dtype(cfg: TargetConfig, device: torch.device) -> torch.dtype:
    if cfg.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, cfg.dtype)


def gguf_cache(cfg: TargetConfig) -> Path | None:
    """For a local GGUF target: an HF directory with its dequantized float32 weights, config and
    tokenizer, made on first use and shared by every later load. Parsing a GGUF costs 15-40 s
    per load (config, tokenizer and weights each parse it), a job's whole budget on a small
    target; the directory loads in about a second. Keyed by the GGUF's sha256 and CONVERSION
    under storage.CACHE_DIR ($DFLASHPIPE_CACHE, default ~/.cache/dflashpipe); None for other
    targets."""
    if not cfg.gguf_file or not _is_local(cfg):
        return None
    gguf = Path(cfg.model) / cfg.gguf_file
    if not gguf.is_file():
        raise DataError(f"target GGUF file {gguf} does not exist{_fetch_hint(gguf)}")
    final = storage.CACHE_DIR / "gguf" / f"{_file_sha256(gguf)}.v{CONVERSION}"
    if (final / "config.json").is_file():
        return final
    log.info("converting %s to %s (once)", gguf, final)
    try:
        _convert_gguf(cfg, final)
    except OSError as e:  # no room or no write access: the GGUF still loads, only slower
        log.warning("cannot write %s (%s); loading %s directly", final, e, gguf)
        return None
    return final


@contextmanager
def parsed_once() -> Iterator[None]:
    """Inside the block, every `gguf.GGUFReader(path)` of one path returns one reader. Converting
    a GGUF parses it four times (transformers' config, tokenizer and weights loads each, and
    gguf_tokenizer's check), and a parse of its metadata is Python over every vocabulary entry:
    18 s a parse for Gemma 3's 262K tokens on the 2-core machine. The readers are read-only
    memory maps, so sharing one is safe; transformers and gguf_tokenizer import the class when
    they parse, so they find this one."""
    import gguf

    original, readers = gguf.GGUFReader, {}

    def reader(path, mode="r"):
        key = (Path(path).resolve(), mode)
        if key not in readers:
            readers[key] = original(path, mode)
        return readers[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = original


def _convert_gguf(cfg: TargetConfig, final: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name[:16]}.", dir=final.parent))
    tmp.chmod(0o755)
    try:
        kwargs = {"gguf_file": cfg.gguf_file, "local_files_only": True}
        try:
            with parsed_once():
                tok = AutoTokenizer.from_pretrained(cfg.model, **kwargs)
                tok = gguf_tokenizer.checked(tok, Path(cfg.model) / cfg.gguf_file)
                model = AutoModelForCausalLM.from_pretrained(
                    cfg.model, dtype=torch.float32, **kwargs
                )
        except (OSError, ValueError, ImportError) as e:
            raise DataError(f"cannot load target {Path(cfg.model) / cfg.gguf_file}: {e}") from None
        tok.save_pretrained(tmp)
        # save_pretrained refuses models loaded through the GGUF quantizer; the weights are
        # plain float32 tensors by now, so they are written directly, each storage once under
        # its first name (a tied LM head is the embedding: the embedding's name is kept).
        weights, seen = {}, set()
        for key, value in model.state_dict().items():
            if value.untyped_storage().data_ptr() not in seen:
                seen.add(value.untyped_storage().data_ptr())
                weights[key] = value.contiguous()
        safetensors.torch.save_file(weights, str(tmp / "model.safetensors"))
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        if model.generation_config is not None:
            model.generation_config.save_pretrained(tmp)
        config.save_pretrained(tmp)  # config.json last: its presence marks a whole directory
        try:
            tmp.rename(final)
        except OSError:  # another job finished the same conversion first
            if not (final / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _source(cfg: TargetConfig) -> tuple[str, dict]:
    """(name or directory, from_pretrained kwargs) the target's weights load from."""
    cached = gguf_cache(cfg)
    if cached is not None:
        return str(cached), {"local_files_only": True}
    return cfg.model, _hub_kwargs(cfg, _is_local(cfg))


def load_tokenizer(cfg: TargetConfig, source: tuple[str, dict] | None = None):
    """The target's tokenizer (`source`: the target's `_source`, when the caller has it)."""
    from transformers import AutoTokenizer

    if cfg.tokenizer:
        name, kwargs = cfg.tokenizer, _hub_kwargs(cfg, Path(cfg.tokenizer).exists())
        kwargs.pop("gguf_file", None)
    else:
        name, kwargs = source or _source(cfg)
    try:
        tok = AutoTokenizer.from_pretrained(name, **kwargs)
    except OSError as e:
        raise DataError(f"cannot load the tokenizer of target {name!r}: {e}") from None
    if not cfg.tokenizer and cfg.gguf_file and name != cfg.model:  # loaded from the conversion
        tok.name_or_path = str(Path(cfg.model) / cfg.gguf_file)  # messages name the user's file
    apply_template_choice(tok, cfg.chat_template)  # none left: plain-text prompts (chat.py)
    return tok


def load_target(cfg: TargetConfig, device: torch.device, base_only: bool = False):
    """(model, tokenizer) in eval mode on `device`: bf16 on GPU, float32 on CPU by default.
    `base_only` loads the decoder stack without the LM head (AutoModel), as extract needs."""
    from transformers import AutoModel, AutoModelForCausalLM

    start = time.perf_counter()
    name, kwargs = _source(cfg)  # once: for a GGUF target it looks up (or makes) the conversion
    tok = load_tokenizer(cfg, (name, kwargs))
    attn = attention_choice(cfg, (name, kwargs))
    try:
        model = (AutoModel if base_only else AutoModelForCausalLM).from_pretrained(
            name,
            dtype=torch_dtype(cfg, device),
            attn_implementation=attention.implementation(attn),
            **kwargs,
        )
    except (OSError, ValueError, ImportError) as e:
        raise DataError(f"cannot load target {cfg.model!r}: {e}") from None
    model.to(device).eval().requires_grad_(False)
    log.info("target %s loaded on %s in %.1f s (attention %s, %s prompts)", name, device,
             time.perf_counter() - start, attn, prompt_format(tok))  # fmt: skip
    return model, tok


def attention_choice(cfg: TargetConfig, source: tuple[str, dict] | None = None) -> str:
    """target.attn_implementation for this target, as the config names it: auto -> sdpa where
    its family has SDPA attention in transformers, else eager (transformers_support.resolve_attention);
    an explicit choice the family refuses -> ConfigError. `source`: as in load_tokenizer."""
    model_type = load_target_config(cfg, source).model_type
    return transformers_support.resolve_attention(
        cfg.attn_implementation, transformers_support.family(model_type)
    )


def load_target_config(cfg: TargetConfig, source: tuple[str, dict] | None = None):
    """The target's transformers config alone (no weights): for checks before a stage takes a
    device (`source`: as in load_tokenizer)."""
    from transformers import AutoConfig

    name, kwargs = source or _source(cfg)
    try:
        return AutoConfig.from_pretrained(name, **kwargs)
    except (OSError, ValueError) as e:
        raise DataError(f"cannot load the config of target {cfg.model!r}: {e}") from None


def weight_files(cfg: TargetConfig) -> list[Path]:
    """The files whose bytes define the target's weights."""
    root = Path(cfg.model)
    if not root.exists():
        from huggingface_hub import snapshot_download

        patterns = [cfg.gguf_file] if cfg.gguf_file else [f"*{s}" for s in WEIGHT_SUFFIXES]
        root = Path(snapshot_download(cfg.model, revision=cfg.revision, allow_patterns=patterns))
    if cfg.gguf_file:
        return [root / cfg.gguf_file]
    if root.is_file():
        return [root]
    files = sorted(p for p in root.iterdir() if p.suffix in WEIGHT_SUFFIXES)
    if not files:
        raise DataError(f"no weight files ({', '.join(WEIGHT_SUFFIXES)}) in {root}")
    return files


def _file_sha256(path: Path) -> str:
    """sha256 of a weight file (targets are tens of GB: remembered, see `cached_sha256`)."""
    real = path.resolve()
    if len(real.name) == 64 and real.parent.name == "blobs":
        return real.name  # the HF cache names LFS blobs by their sha256
    return storage.cached_sha256(real)


def tokenizer_sha256(tok) -> str:
    backend = getattr(tok, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else json.dumps(tok.get_vocab(), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def chat_template_sha256(tok) -> str:
    template = tok.chat_template
    text = template if isinstance(template, str) else json.dumps(template, sort_keys=True)
    return hashlib.sha256((text or "").encode()).hexdigest()


def target_identity(cfg: TargetConfig, tok) -> TargetIdentity:
    digest = hashlib.sha256()
    for f in weight_files(cfg):
        digest.update(f"{f.name}:{_file_sha256(f)}\n".encode())
    name = cfg.model + (f"/{cfg.gguf_file}" if cfg.gguf_file else "")
    return TargetIdentity(
        name, digest.hexdigest(), tokenizer_sha256(tok), chat_template_sha256(tok),
        attention_choice(cfg), prompt_format(tok),
    )  # fmt: skip
