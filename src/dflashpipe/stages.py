"""What each stage reads of the config: the one declaration digests, resume and docs derive from.

    config key ──► STAGES[stage].reads ──► rule digest (reads - inert)   an edit reruns exactly
                                       │                                the stages that read it
                                       ├─► train's resume fingerprint    (reads - inert - resume_safe)
                                       └─► README's rerun table, the key-change matrix test

A key is a dotted path to a leaf of the schema (`extract.max_length`); `section.*` stands for
every leaf of a section, expanded from the schema, so a key added there is read by that stage
without a second edit here. Snakemake reruns what lies downstream of a rerun stage by itself
(its inputs change), so a stage lists only what it reads itself.

- `inert`: keys the stage reads that never change what it writes (which GPU, how many helper
  processes); they are left out of its digest, so moving a run to other devices reruns nothing.
- `resume_safe` (train): keys that may change between a checkpoint and its resumption (logging
  and checkpoint cadence, a longer run); any other change starts a fresh run.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import cache
from typing import Any

from dflashpipe.config import Config, load_schema


@dataclass(frozen=True)
class Stage:
    rules: tuple[str, ...]  # the Snakemake rules whose digest this is
    reads: tuple[str, ...]
    after: tuple[str, ...] = ()  # stages whose outputs it reads (what a rerun carries downstream)
    inert: tuple[str, ...] = ()
    resume_safe: tuple[str, ...] = ()


STAGES: dict[str, Stage] = {
    # each retrieve job's digest is its own entry's (common.smk), so an edit refetches one file
    "retrieve": Stage(rules=("retrieve",), reads=("retrieve",)),
    "prompts": Stage(rules=("prompts",), reads=("prompts.*",), after=("retrieve",)),
    "regenerate": Stage(
        rules=("regenerate_shard",),
        # the answer's room: prompts longer than extract.max_length minus one token are skipped
        reads=("target.*", "regenerate.*", "extract.max_length", "devices.extract"),
        after=("prompts", "retrieve"),
        inert=("devices.extract",),
    ),
    "extract": Stage(
        rules=("extract_shard",),
        reads=(
            "target.*",
            "extract.*",
            "drafter.target_layer_ids",
            "drafter.num_target_layers",
            "devices.extract",
        ),  # fmt: skip
        after=("regenerate", "retrieve"),
        inert=("devices.extract", "extract.encode_workers", "extract.direct_io"),
    ),
    "train": Stage(
        rules=("train",),
        reads=(
            "target.*",
            "drafter.num_layers",
            "drafter.block_size",
            "drafter.target_layer_ids",
            "drafter.mask_token_id",
            "drafter.sliding_window",
            "drafter.init",
            "drafter.architecture",
            "drafter.conv_kernel_size",
            "drafter.conv_group_size",
            "drafter.selector_rank",
            "drafter.selector_top_k",
            "train.*",
            "devices.train",
        ),  # fmt: skip
        after=("extract", "retrieve"),
        inert=("devices.train", "train.num_workers"),
        resume_safe=(
            "train.epochs",
            "train.max_steps",
            "train.log_every",
            "train.val_every",
            "train.checkpoint_every",
            "train.keep_checkpoints",
            "train.compile",
        ),  # fmt: skip
    ),
    "evaluate": Stage(
        rules=("evaluate",),
        # prompts are encoded the way regenerate encoded them (thinking on or off)
        reads=("target.*", "evaluate.*", "regenerate.enable_thinking", "devices.extract"),
        after=("train", "prompts", "retrieve"),
        inert=("devices.extract",),
    ),
    "report": Stage(rules=("report",), reads=(), after=("evaluate", "train", "extract", "prompts")),
}


@cache
def schema_leaves() -> tuple[str, ...]:
    """Every leaf key of the schema as a dotted path: a property that is not an object with
    properties of its own (lists, open maps such as `retrieve` and scalars are leaves)."""

    def walk(schema: dict, prefix: str) -> list[str]:
        props = schema.get("properties")
        if schema.get("type") != "object" or not props:
            return [prefix]
        return [leaf for name, sub in props.items() for leaf in walk(sub, f"{prefix}.{name}")]

    top = load_schema()["properties"]
    return tuple(leaf for name, sub in top.items() for leaf in walk(sub, name))


def expand(keys: tuple[str, ...]) -> tuple[str, ...]:
    """Declared keys with `section.*` expanded to the section's leaves; an unknown key is a bug
    of the declaration (KeyError naming it)."""
    leaves = schema_leaves()
    out: list[str] = []
    for key in keys:
        if key.endswith(".*"):
            found = [leaf for leaf in leaves if leaf.startswith(key[:-1])]
        else:
            found = [key] if key in leaves else []
        if not found:
            raise KeyError(f"stages.py declares {key!r}, which is no key of the config schema")
        out += [k for k in found if k not in out]
    return tuple(out)


def reads(stage: str) -> tuple[str, ...]:
    return expand(STAGES[stage].reads)


def digest_keys(stage: str) -> tuple[str, ...]:
    """The keys whose values a stage's rule digest covers: everything it reads but the inert."""
    inert = set(expand(STAGES[stage].inert))
    return tuple(k for k in reads(stage) if k not in inert)


def fingerprint_keys(stage: str = "train") -> tuple[str, ...]:
    """The keys a checkpoint must agree on to be resumed: the digest's minus the resume-safe."""
    safe = set(expand(STAGES[stage].resume_safe))
    return tuple(k for k in digest_keys(stage) if k not in safe)


def downstream(stages: set[str]) -> set[str]:
    """`stages` and every stage that reads their outputs, directly or not."""
    out = set(stages)
    changed = True
    while changed:
        changed = False
        for name, stage in STAGES.items():
            if name not in out and out.intersection(stage.after):
                out.add(name)
                changed = True
    return out


def readers(key: str) -> set[str]:
    """The stages whose digest covers `key` (a leaf)."""
    return {name for name in STAGES if key in digest_keys(name)}


ABSENT = object()


def value(raw: dict, key: str) -> Any:
    """The value of a dotted key in a resolved config; ABSENT where it is not set."""
    node: Any = raw
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return ABSENT
        node = node[part]
    return node


def digest(cfg: Config, stage: str) -> str:
    """Short hash of the values of the stage's digest keys. A key left unset (the few without a
    schema default) stays out, so adding such a key to the schema keeps finished runs current;
    nothing path- or machine-specific enters, so a copied run stays current too."""
    return hash_values({k: v for k in digest_keys(stage) if (v := value(cfg.raw, k)) is not ABSENT})


def hash_values(values: dict) -> str:
    return hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()[:16]


def rerun_table() -> str:
    """README's table of what an edit reruns, from the declarations: the schema's leaves grouped
    by section and by the stages an edit to them reruns; a section's largest group is written
    `section.*` (with "other" where the section's other groups follow)."""
    order = list(STAGES)
    groups: dict[str, dict[tuple[str, ...], list[str]]] = {}
    for key in schema_leaves():
        runs = tuple(s for s in order if s in downstream(readers(key)))
        groups.setdefault(key.split(".")[0], {}).setdefault(runs, []).append(key)
    rows = ["| an edit to | reruns |", "|---|---|"]
    for section, by_runs in groups.items():
        largest = max(by_runs, key=lambda r: len(by_runs[r]))
        for runs, keys in by_runs.items():
            if runs == largest and "." in keys[0]:
                names = f"{'other ' if len(by_runs) > 1 else ''}`{section}.*`"
            else:
                names = ", ".join(f"`{k}`" for k in keys)
            rows.append(f"| {names} | {', '.join(runs) if runs else 'nothing'} |")
    safe = ", ".join(f"`{k}`" for k in expand(STAGES["train"].resume_safe))
    return "\n".join(rows) + f"\n\nTrain resumes its checkpoints after edits to {safe} alone."
