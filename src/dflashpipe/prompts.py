"""Stage 1, prompts: sources -> normalized messages -> turn expansion -> dedupe -> filters ->
held-out split -> limits -> seeded shuffle -> train.parquet, eval.parquet, stats.json.

Reads the configured sources in order; eval-only sources are deduplicated first so that a
training copy of an eval prompt is the one dropped (no contamination of the eval set).

`trim_history`: a turn whose history is over `max_chars` keeps the longest tail of whole
messages that starts at a user message and fits, instead of being dropped. Such prompts train
only, and the held-out split is drawn from the untrimmed ones alone, so the eval set is the same
with the option as without it. `exclude`: train prompts that other prompt files hold (another
run's train.parquet) are left out, for a run that adds answers beside that run's.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import unicodedata
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from dflashpipe.config import Config, PromptsConfig, SourceConfig
from dflashpipe.errors import DataError
from dflashpipe.sources import DropLog, RawConversation, ReadLog, read_source
from dflashpipe.storage import atomic_path, write_json

log = logging.getLogger(__name__)

ROLES = {
    "user": "user", "human": "user",
    "assistant": "assistant", "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant",
    "bing": "assistant", "model": "assistant",
    "system": "system",
}  # fmt: skip

PROMPT_SCHEMA = pa.schema(
    [
        ("prompt_id", pa.string()),
        ("source", pa.string()),
        ("conversation_id", pa.string()),
        ("turn", pa.int32()),
        ("messages", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
        ("reference", pa.string()),
        ("origin", pa.string()),
    ]
)


@dataclass
class Prompt:
    prompt_id: str
    source: str
    conversation_id: str
    turn: int  # index of the answered user turn within its conversation
    messages: list[dict]  # history ending with a user turn
    reference: str | None  # the dataset's own answer, when it has one
    origin: str
    history_cut: int = field(default=0, compare=False)  # leading messages trimmed (not stored)


class BadConversation(ValueError):
    """A conversation that cannot become prompts; args[0] is the drop reason."""


def normalize_turns(turns: list[tuple[str, str]], extra_roles: dict[str, str]) -> list[dict]:
    """Map role names, strip text, merge consecutive same-role turns, drop leading assistant
    turns (they answer nothing); raise BadConversation for what cannot be repaired."""
    roles = {**ROLES, **{k.lower(): v for k, v in extra_roles.items()}}
    out: list[dict] = []
    for role_name, content in turns:
        role = roles.get(role_name.strip().lower())
        if role is None:
            raise BadConversation("unknown_role", role_name)
        text = unicodedata.normalize("NFC", content).strip()
        if not text:
            raise BadConversation("empty_message", role_name)
        if role == "system" and out:
            raise BadConversation("system_not_first", len(out))
        if out and out[-1]["role"] == role:
            out[-1]["content"] += "\n\n" + text
        elif role == "assistant" and (not out or out[-1]["role"] == "system"):
            continue
        else:
            out.append({"role": role, "content": text})
    if not any(m["role"] == "user" for m in out):
        raise BadConversation("empty_conversation")
    return out


def canonical(message: dict) -> tuple[str, str]:
    """A message as the prompt key sees it: (role, NFKC text with every whitespace run made one
    space, ends stripped). `str.split()` splits on the characters regex `\\s` matches."""
    return message["role"], " ".join(unicodedata.normalize("NFKC", message["content"]).split())


def prompt_key(messages: list[dict], canon: list[tuple[str, str]] | None = None) -> str:
    """Content hash of the normalized messages: the stable prompt_id and the dedupe key.
    `canon`: the messages' canonical() forms, when the caller has them (a conversation's turns
    share their history: each message is normalized once, not once per later turn)."""
    canon = [canonical(m) for m in messages] if canon is None else canon
    return hashlib.sha256(json.dumps(canon, ensure_ascii=False).encode()).hexdigest()[:20]


def expand(conv: list[dict]) -> list[tuple]:
    """(turn, history ending with that user turn, its answer or None), one per user turn."""
    users = [i for i, m in enumerate(conv) if m["role"] == "user"]
    return [
        (turn, conv[: i + 1], conv[i + 1]["content"] if i + 1 < len(conv) else None)
        for turn, i in enumerate(users)
    ]


def passes_filters(messages: list[dict], reference: str | None, cfg: PromptsConfig) -> str | None:
    """The reason a prompt (its messages and the dataset's answer) is filtered out, or None."""
    chars = sum(len(m["content"]) for m in messages)
    if chars < cfg.min_chars:
        return "too_short"
    if cfg.max_chars is not None and chars > cfg.max_chars:
        return "too_long"
    if cfg.max_turns is not None and sum(m["role"] == "user" for m in messages) > cfg.max_turns:
        return "too_many_turns"
    if cfg.max_reference_chars is not None and len(reference or "") > cfg.max_reference_chars:
        return "reference_too_long"
    return None


def collect(src: SourceConfig, cfg: PromptsConfig, stats: dict) -> list[Prompt]:
    """Every prompt of one source after normalization, expansion and filters (before dedupe)."""
    drops, files = DropLog(), ReadLog()
    prompts, n_conv = [], 0
    conversations = read_source(src, drops, files)
    for raw in tqdm(conversations, desc=f"read {src.name}", unit=" conv", mininterval=2):
        n_conv += 1
        prompts += _prompts_of(raw, src, cfg, drops)
    if files.path:  # a code source: which code, so two runs can be compared
        stats["files"] = files.summary()
    stats.update(conversations=n_conv, prompts=len(prompts), dropped=drops.counts)
    stats["drop_examples"] = drops.examples
    if n_conv == 0:
        where = src.path or src.dataset
        raise DataError(f"prompts.sources '{src.name}': {where} holds no conversations")
    return prompts


def _prompts_of(raw: RawConversation, src: SourceConfig, cfg: PromptsConfig, drops: DropLog):
    try:
        conv = normalize_turns(raw.turns, src.roles)
    except BadConversation as e:
        drops.drop(e.args[0], raw.origin, str(e.args[1]) if len(e.args) > 1 else "")
        return []
    items = expand(conv)
    if not cfg.keep_unanswered:
        for turn, _, answer in items:
            if answer is None:
                drops.drop("unanswered", raw.origin, f"turn {turn}")
        items = [it for it in items if it[2] is not None]
    if not cfg.expand_turns:
        items = items[-1:]  # earlier turns stay in the history of the last one
    out, canon = [], []  # canonical() of conv's messages, made as far as a kept turn needs
    for turn, history, answer in items:
        reason = passes_filters(history, answer, cfg)
        cut = 0
        if reason == "too_long" and cfg.trim_history:
            cut = history_tail(history, cfg.max_chars)
            reason = passes_filters(history[cut:], answer, cfg)
        if reason:
            drops.drop(reason, raw.origin, f"turn {turn}")
            continue
        canon += [canonical(m) for m in history[len(canon) :]]
        key = prompt_key(history[cut:], canon[cut : len(history)])
        out.append(Prompt(key, src.name, raw.conversation_id, turn, history[cut:], answer,
                          raw.origin, cut))  # fmt: skip
    return out


def history_tail(history: list[dict], max_chars: int) -> int:
    """Where the longest tail of whole messages that starts at a user message and holds at most
    max_chars begins; the last message's index (a user turn) where even it alone is longer."""
    start, chars = len(history) - 1, 0
    for i in range(len(history) - 1, -1, -1):
        chars += len(history[i]["content"])
        if chars > max_chars:
            break
        if history[i]["role"] == "user":
            start = i
    return start


def dedupe(per_source: dict[str, list[Prompt]], order: list[str], stats: dict) -> None:
    """Drop repeats of a prompt_id, in place; earlier sources in `order` keep theirs, and
    untrimmed prompts keep theirs over trimmed ones (which must not change the eval set)."""
    seen: set[str] = set()
    kept: dict[str, set[int]] = {name: set() for name in order}
    for trimmed in (False, True):
        for name in order:
            for i, p in enumerate(per_source[name]):
                if bool(p.history_cut) != trimmed:
                    continue
                if p.prompt_id in seen:
                    stats[name]["dropped"]["duplicate"] += 1
                else:
                    seen.add(p.prompt_id)
                    kept[name].add(i)
    for name in order:
        per_source[name] = [p for i, p in enumerate(per_source[name]) if i in kept[name]]


def split_source(src: SourceConfig, prompts: list[Prompt], rng: random.Random):
    """(train, eval): whole conversations are held out, so no conversation spans both splits.
    Trimmed prompts never evaluate, and the held-out conversations are drawn from the untrimmed
    prompts' alone (the same draw as without trim_history); trimmed prompts of a held-out
    conversation are left out."""
    whole = [p for p in prompts if not p.history_cut]
    if src.split != "both":
        return (prompts, []) if src.split == "train" else ([], whole)
    conv_ids = sorted({p.conversation_id for p in whole})
    rng.shuffle(conv_ids)
    held = set(conv_ids[: src.eval_count])
    return [p for p in prompts if p.conversation_id not in held], [
        p for p in whole if p.conversation_id in held
    ]


def excluded_ids(paths: list[str]) -> set[str]:
    """The prompt ids of other prompt files (prompts.exclude)."""
    ids: set[str] = set()
    for path in paths:
        if not Path(path).is_file():
            raise DataError(f"prompts.exclude: {path} does not exist")
        ids.update(pq.read_table(path, columns=["prompt_id"]).column("prompt_id").to_pylist())
    return ids


def train_quotas(cfg: PromptsConfig, available: dict[str, int]) -> dict[str, int]:
    """Per-source caps: the source's `limit`, and its weighted share of max_train."""
    quotas = {}
    weights = {s.name: s.weight for s in cfg.sources if available.get(s.name)}
    total_w = sum(weights.values())
    for s in cfg.sources:
        q = available.get(s.name, 0)
        if s.limit is not None:
            q = min(q, s.limit)
        if cfg.max_train is not None and s.name in weights:
            q = min(q, round(cfg.max_train * weights[s.name] / total_w))
        quotas[s.name] = q
    return quotas


def build(cfg: PromptsConfig) -> tuple[list[Prompt], list[Prompt], dict]:
    """The whole stage in memory: (train prompts, eval prompts, stats)."""
    stats: dict[str, dict] = {}
    per_source = {}
    for src in cfg.sources:
        stats[src.name] = {"kind": src.kind, "split": src.split}
        per_source[src.name] = collect(src, cfg, stats[src.name])
    order = [s.name for s in cfg.sources if s.split == "eval"]
    order += [s.name for s in cfg.sources if s.split != "eval"]
    if cfg.dedupe:
        dedupe(per_source, order, stats)
    for name, prompts in per_source.items():
        stats[name]["added"] = len(prompts)  # after filters and dedupe, before split and limits
    rng = random.Random(cfg.seed)
    train_by, eval_by = {}, {}
    excluded = excluded_ids(cfg.exclude)
    for src in cfg.sources:
        train_by[src.name], eval_by[src.name] = split_source(src, per_source[src.name], rng)
        split = len(train_by[src.name]) + len(eval_by[src.name])
        if split < len(per_source[src.name]):  # trimmed turns of held-out conversations
            dropped = len(per_source[src.name]) - split
            stats[src.name]["dropped"]["trimmed_held_out"] += dropped
        if excluded:
            kept = [p for p in train_by[src.name] if p.prompt_id not in excluded]
            stats[src.name]["dropped"]["excluded"] += len(train_by[src.name]) - len(kept)
            train_by[src.name] = kept
        if src.split == "eval" and src.limit is not None:
            eval_by[src.name] = _take(eval_by[src.name], src.limit, rng, stats[src.name])
    quotas = train_quotas(cfg, {k: len(v) for k, v in train_by.items()})
    train, evals = [], []
    for src in cfg.sources:
        train_by[src.name] = _take(train_by[src.name], quotas[src.name], rng, stats[src.name])
        train += train_by[src.name]
        evals += eval_by[src.name]
        stats[src.name].update(train=len(train_by[src.name]), eval=len(eval_by[src.name]))
        if cfg.trim_history:
            stats[src.name]["trimmed"] = sum(p.history_cut > 0 for p in train_by[src.name])
    rng.shuffle(train)
    # evaluate reads the first eval rows: their order must not follow how many draws train took
    random.Random(f"{cfg.seed}:eval").shuffle(evals)
    return train, evals, _finish_stats(stats, train, evals)


def _take(prompts: list[Prompt], n: int, rng: random.Random, stats: dict) -> list[Prompt]:
    if len(prompts) <= n:
        return prompts
    stats["dropped"]["over_limit"] += len(prompts) - n
    keep = sorted(rng.sample(range(len(prompts)), n))
    return [prompts[i] for i in keep]


def _finish_stats(stats: dict, train: list[Prompt], evals: list[Prompt]) -> dict:
    for s in stats.values():
        s["dropped"] = dict(sorted(s["dropped"].items()))
    dropped = Counter()
    for s in stats.values():
        dropped.update(s["dropped"])
    totals = {"train": len(train), "eval": len(evals), "dropped": dict(sorted(dropped.items()))}
    return {"sources": stats, "totals": totals}


def write_prompts(dest: str | Path, prompts: list[Prompt]) -> None:
    rows = [{k: getattr(p, k) for k in PROMPT_SCHEMA.names} for p in prompts]
    table = pa.Table.from_pylist(rows, schema=PROMPT_SCHEMA)
    with atomic_path(dest) as tmp:
        pq.write_table(table, tmp, compression="zstd")


@dataclass(frozen=True)
class PromptsPaths:
    """The three files the prompts stage writes."""

    train: Path
    eval: Path
    stats: Path


def run(cfg: Config, paths: PromptsPaths) -> dict:
    """Build the prompt sets and write the three outputs (each atomically, stats last)."""
    train, evals, stats = build(cfg.prompts)
    write_prompts(paths.train, train)
    write_prompts(paths.eval, evals)
    write_json(paths.stats, stats)
    log.info(
        "prompts: %d train, %d eval; dropped %s", len(train), len(evals), stats["totals"]["dropped"]
    )
    return stats


def read_prompts(path: str | Path) -> list[dict]:
    """Rows of a prompts table as dicts (for later stages and tests)."""
    return pq.read_table(path).to_pylist()
