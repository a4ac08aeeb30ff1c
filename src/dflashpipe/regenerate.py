"""Stage 2, regenerate: the target answers the training prompts of one shard.

    prompts/train.parquet ──(rows i::n)──► length-sorted plan ──► samples_per_prompt answers each
        answers.py, one stream of answers from either engine (regenerate.engine):
          static: the batched engine (decoding/batched.py), every answer in one stream, a row
                  slot refilled once its answer ends (refills gathered into packs)
          hf:     generate() on left-padded batches, answer index s by s
        ──► save_parts, the one loop: a part file once its answers are in (resume skips the
            parts on disk; progress and log per part) ──► identical answers to one prompt dropped
        ──► sequences/shard-{i:05d}.parquet (the engine in its metadata)

Each row holds exactly the tokens the target saw and produced (`input_ids`), a `loss_mask` that
is 1 only on generated tokens, and a `finish_reason`; its `sample_id` is `{prompt_id}-{s}`.
With `samples_per_prompt: n` every prompt is answered n times: answer 0 greedy (`greedy_first`),
the others sampled at the stage's temperature / top_p / top_k. On the engine each sampled answer
draws from its own generator, seeded by (seed, prompt id, answer index); on generate() each
sampled batch from one seeded by (seed, shard, sample index, batch). Either way a rerun or a
resumed run draws the same numbers; it gives the same answers where the kernels are
deterministic (the CPU; batched bf16 decoding on a GPU is not bit-exact from run to run, greedy
answers included). The plan is fixed up front from the whole shard, so a resumed run's parts
hold the answers an uninterrupted run's do; finished parts live beside the output and are never
redone. With `regenerate.enabled: false` the rows hold the datasets' own answers, tokenized with
an assistant-only mask.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from dflashpipe.answers import ShardPlan, Source, hf_source, static_source
from dflashpipe.chat import encode_chat, encode_prompt, encode_prompts, end_of_turn_ids
from dflashpipe.config import Config, RegenerateConfig
from dflashpipe.devices import ANY_DEVICE, DeviceLease
from dflashpipe.errors import ConfigError, DataError
from dflashpipe.storage import atomic_path

log = logging.getLogger(__name__)

SEQUENCE_SCHEMA = pa.schema(
    [
        ("sample_id", pa.string()),
        ("prompt_id", pa.string()),
        ("input_ids", pa.list_(pa.int32())),
        ("loss_mask", pa.list_(pa.uint8())),
        ("num_prompt_tokens", pa.int32()),
        ("finish_reason", pa.string()),
    ]
)


def shard_rows(prompts_path: Path, shard: int, num_shards: int) -> list[dict]:
    """Rows shard::num_shards of the (already shuffled) prompt table."""
    if not 0 <= shard < num_shards:
        raise DataError(f"shard index {shard} is out of range for regenerate.shards={num_shards}")
    if not prompts_path.is_file():
        raise DataError(f"prompt table not found: {prompts_path}")
    rows = pq.read_table(prompts_path).to_pylist()
    if not rows:
        raise DataError(f"{prompts_path} holds no prompts; nothing to regenerate")
    return rows[shard::num_shards]


def plan_batches(lengths: list[int], batch_size: int) -> list[list[int]]:
    """Indices grouped into batches of similar length (longest first: memory peaks early)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


class PartStore:
    """Finished batches of an unfinished shard, as part files beside the final output."""

    def __init__(self, out: Path):
        self.dir = out.parent / f".{out.name}.parts"

    def bind(self, plan: str) -> None:
        """Tie the parts to the plan that makes them (`plan`: a digest of the stage's settings,
        the target and the batches). Parts that another plan left (an edited config, another
        target or prompt table) are not this shard's answers: discarded, with a warning, not
        mixed in."""
        key = self.dir / "plan.sha256"
        if self.dir.is_dir() and (not key.is_file() or key.read_text() != plan):
            if n := len(self.done()):
                log.warning(
                    "%s: %d part files were made with another plan (the regenerate section, the "
                    "target or the prompts differ); discarding them and starting over",
                    self.dir,
                    n,
                )
            self.clear()
        if not key.is_file():
            self.dir.mkdir(parents=True, exist_ok=True)
            with atomic_path(key) as tmp:
                tmp.write_text(plan)

    def done(self) -> dict[int, Path]:
        if not self.dir.is_dir():
            return {}
        return {int(p.stem.split("-")[1]): p for p in self.dir.glob("part-*.parquet")}

    def save(self, first_batch: int, rows: list[dict], stats: Counter) -> None:
        table = pa.Table.from_pylist(rows, schema=SEQUENCE_SCHEMA)
        table = table.replace_schema_metadata({"stats": json.dumps(stats)})
        with atomic_path(self.dir / f"part-{first_batch:06d}.parquet") as tmp:
            pq.write_table(table, tmp)

    def load(self) -> tuple[list[dict], Counter]:
        rows, stats = [], Counter()
        for _, path in sorted(self.done().items()):
            table = pq.read_table(path)
            stats.update(json.loads(table.schema.metadata[b"stats"]))
            rows += table.to_pylist()
        return rows, stats

    def clear(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def dataset_rows(rows: list[dict], tok, enable_thinking, stats: Counter) -> list[dict]:
    """regenerate disabled: the datasets' own answers with an assistant-only loss mask (every
    assistant turn of the history is supervised too: they are real answers)."""
    out = []
    for r in rows:
        if r["reference"] is None:
            stats["no_reference"] += 1
            continue
        messages = [*r["messages"], {"role": "assistant", "content": r["reference"]}]
        try:
            ids, mask = encode_chat(tok, messages, enable_thinking)
            n_prompt = len(encode_prompt(tok, r["messages"], enable_thinking))
        except DataError as e:
            stats["template_error"] += 1
            log.warning("prompt %s skipped: %s", r["prompt_id"], e)
            continue
        out.append(_row(r, ids, mask, n_prompt, "dataset"))
    return out


def _row(
    prompt_row: dict, ids: list[int], mask: list[int], n_prompt: int, finish: str, sample: int = 0
) -> dict:
    return {
        "sample_id": f"{prompt_row['prompt_id']}-{sample}",
        "prompt_id": prompt_row["prompt_id"],
        "input_ids": ids,
        "loss_mask": mask,
        "num_prompt_tokens": n_prompt,
        "finish_reason": finish,
    }


def part_rows(rows: list[dict], prompts: list[list[int]], answered: list[tuple]
              ) -> tuple[list[dict], Counter]:  # fmt: skip
    """A part file's rows and finish counts from (sample, prompt index, new tokens, finish)."""
    out, stats = [], Counter()
    for sample, i, new, finish in answered:
        mask = [0] * len(prompts[i]) + [1] * len(new)
        out.append(_row(rows[i], prompts[i] + new, mask, len(prompts[i]), finish, sample))
        stats[f"finish_{finish}"] += 1
    return out, stats


def dedupe_answers(rows: list[dict], stats: Counter) -> list[dict]:
    """The first of each set of identical answers to one prompt (counted as duplicate_answers)."""
    seen, out = set(), []
    for r in rows:
        key = (r["prompt_id"], tuple(r["input_ids"]))
        if key in seen:
            stats["duplicate_answers"] += 1
            continue
        seen.add(key)
        out.append(r)
    return out


def save_parts(source: Source, todo: list[int], plan: ShardPlan, parts: PartStore,
               limit: int | None) -> bool:  # fmt: skip
    """The one loop over either engine's answers: each part file saved once all its answers are
    in (the engine's finish out of order), with progress and a log line per part. False when
    stopped once the saved parts count `limit` batches (--max-batches; the engine's parts count
    one each) and parts are left."""
    total = sum(map(len, source.parts.values()))
    bar = tqdm(total=total, desc="regenerate", unit=" answer", mininterval=2)
    bar.update(total - sum(len(source.parts[k]) for k in todo))
    got: dict[int, dict] = defaultdict(dict)
    saved, spent, new_tokens, start = 0, 0, 0, time.perf_counter()
    try:
        for k, place, tokens, finish in source.answers(todo):
            got[k][place] = (tokens, finish)
            new_tokens += len(tokens)
            bar.update(1)
            if len(got[k]) < len(source.parts[k]):
                continue
            done = got.pop(k)
            answered = [(s, i, *done[n]) for n, (s, i) in enumerate(source.parts[k])]
            parts.save(k, *part_rows(plan.rows, plan.prompts, answered))
            saved, spent = saved + 1, spent + source.cost[k]
            rate = new_tokens / (time.perf_counter() - start)
            log.info("part %d saved (%d answers); %d new tokens so far, %.0f tok/s%s", k,
                     len(answered), new_tokens, rate,
                     f"; {f}" if (f := source.figures()) else "")  # fmt: skip
            bar.set_postfix(tok_s=f"{rate:.0f}")
            if limit is not None and spent >= limit and saved < len(todo):
                return False
    finally:
        bar.close()
    return True


def regenerate_rows(rows: list[dict], model, tok, gen: RegenerateConfig, budget: int,
                    parts: PartStore, max_batches: int | None = None, shard: int = 0,
                    target: str = "", engine: str = "hf") -> tuple[list[dict], Counter, bool]:  # fmt: skip
    """Generate `samples_per_prompt` answers for each of `rows` on `engine` ("static": the
    batched engine, "hf": generate()), saving a part file every `save_every` answers (hf:
    prompts); returns (rows, stats, finished). Stops at a part boundary once `max_batches`
    batches (static: part files) have run. `target` (the target's identity) joins the plan."""
    t = time.perf_counter()
    prompts = encode_prompts(tok, [r["messages"] for r in rows], gen.enable_thinking)
    log.info("%d prompts encoded in %.1f s", len(prompts), time.perf_counter() - t)
    longest = min(budget - 1, gen.max_prompt_tokens or budget)
    keep = [i for i, p in enumerate(prompts) if len(p) <= longest]
    stats = Counter(prompt_too_long=len(rows) - len(keep))
    by_length = plan_batches([len(prompts[i]) for i in keep], gen.batch_size)
    batches = [[keep[i] for i in b] for b in by_length]
    plan = ShardPlan(rows, prompts, batches, gen, end_of_turn_ids(tok), shard, target)
    source = static_source(model, plan) if engine == "static" else hf_source(model, tok, plan)
    parts.bind(source.digest)
    done = parts.done()
    todo = [k for k in source.parts if k not in done]
    if done:
        log.info("resuming: %d of %d part files already done in %s", len(done),
                 len(todo) + len(done), parts.dir)  # fmt: skip
    if todo and not save_parts(source, todo, plan, parts, max_batches):
        return [], stats, False
    saved, part_stats = parts.load()
    stats.update(part_stats)  # update keeps zero counts (Counter + drops them)
    return dedupe_answers(saved, stats), stats, True


def engine_kind(gen: RegenerateConfig, target) -> tuple[str, str]:
    """(kind, why): the engine regenerate.engine picks for the target (its transformers config,
    read before the weights load): static where the static models support the family, hf
    otherwise (auto) or refused (static)."""
    from dflashpipe.decoding.families import check_target_config
    from dflashpipe.target import load_target_config

    if gen.engine == "hf":
        return "hf", "regenerate.engine: hf"
    try:
        check_target_config(load_target_config(target))
    except ValueError as e:
        if gen.engine == "static":
            raise ConfigError(
                f"regenerate.engine is static, but the static engine refuses the target: {e}; "
                "set regenerate.engine to auto or hf"
            ) from None
        return "hf", f"regenerate.engine auto: transformers' generate(), since {e}"
    return "static", f"regenerate.engine: {gen.engine}"


@dataclass(frozen=True)
class RegeneratePaths:
    """What one regenerate job reads and writes: the prompt table, the shard it answers (rows
    shard::regenerate.shards) and the sequences shard it writes."""

    prompts: Path
    shard: int
    out: Path


def run(cfg: Config, paths: RegeneratePaths, lease: DeviceLease = ANY_DEVICE,
        max_batches: int | None = None) -> bool:  # fmt: skip
    """Write one sequences shard; return False if stopped early by `max_batches` (resumable).
    The device is held only while the target answers (not with regenerate.enabled: false)."""
    from dflashpipe.preflight import check_before_loading
    from dflashpipe.target import load_target, load_tokenizer, target_identity

    out_path, shard = Path(paths.out), paths.shard
    if out_path.is_file():
        PartStore(out_path).clear()  # a kill between the final rename and the cleanup
        log.info("%s is complete; not redone", out_path)
        return True
    # What extract and train would refuse (a tap on the last layer, topk beyond the vocabulary),
    # refused before the costliest stage: on a first run the target was not on disk at the
    # workflow's start, so common.smk could not check it.
    check_before_loading(cfg)
    gen = cfg.regenerate
    rows = shard_rows(Path(paths.prompts), shard, gen.shards)
    parts = PartStore(out_path)
    if not gen.enabled:
        tok = load_tokenizer(cfg.target)
        identity = target_identity(cfg.target, tok).to_json()
        stats: Counter = Counter()
        seqs = dataset_rows(rows, tok, gen.enable_thinking, stats)
        engine, why = "none", "regenerate.enabled: false"
    else:
        engine, why = engine_kind(gen, cfg.target)  # refused before the device is taken
        log.info("engine %s (%s)", engine, why)
        with lease.hold() as device:
            log.info("shard %d: %d prompts on %s", shard, len(rows), device)
            model, tok = load_target(cfg.target, device)
            identity = target_identity(cfg.target, tok).to_json()  # hashed once: the plan's too
            seqs, stats, finished = regenerate_rows(rows, model, tok, gen, cfg.extract.max_length,
                                                    parts, max_batches, shard, identity, engine)  # fmt: skip
            if not finished:
                log.info("stopped after %d %s; rerun to finish %s", max_batches,
                         "part files" if engine == "static" else "batches", out_path)  # fmt: skip
                return False
    order = {r["prompt_id"]: k for k, r in enumerate(rows)}
    seqs.sort(key=lambda r: order[r["prompt_id"]])  # stable: a prompt's answers by sample index
    meta = {
        "target": identity,
        "regenerate": json.dumps(cfg.raw["regenerate"], sort_keys=True),
        "stats": json.dumps({"prompts": len(rows), "samples": len(seqs), **stats}),
        "shard": f"{shard}/{gen.shards}",
        "engine": engine,
        "engine_reason": why,
    }
    table = pa.Table.from_pylist(seqs, schema=SEQUENCE_SCHEMA).replace_schema_metadata(meta)
    with atomic_path(out_path) as tmp:
        pq.write_table(table, tmp, compression="zstd")
    parts.clear()
    log.info("shard %d: %d samples written to %s; %s", shard, len(seqs), out_path, meta["stats"])
    return True
