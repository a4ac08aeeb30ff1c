"""Stage 2, regenerate: the target answers the training prompts of one shard.

    prompts/train.parquet ──(rows i::n)──► length-sorted plan ──► samples_per_prompt answers each
        static (regenerate.engine): the batched engine (decoding/batched.py), every answer in
                one stream, a row slot refilled once its answer ends (refills gathered into packs)
        hf:     generate() on left-padded batches, answer index s by s
        ──► part files every `save_every` answers ──► identical answers to one prompt dropped
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

import hashlib
import json
import logging
import shutil
import time
from collections import Counter, defaultdict
from dataclasses import asdict
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from tqdm import tqdm

from dflashpipe import faults
from dflashpipe.chat import encode_chat, encode_prompt, encode_prompts, end_of_turn_ids
from dflashpipe.config import Config, RegenerateConfig
from dflashpipe.decoding.hf_generate import (
    fitting_rows,
    generate_batch,
    generation_config,
    padded_shape,
)
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


def sampled(gen: RegenerateConfig, sample: int) -> bool:
    """Whether answer `sample` of each prompt is sampled (else greedy)."""
    return gen.temperature > 0 and not (sample == 0 and gen.greedy_first)


def batch_seed(seed: int, shard: int, sample: int, batch: int) -> int:
    """The generator seed of one sampled batch: fixed by its place, not by what ran before."""
    key = repr((seed, shard, sample, batch)).encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


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


def plan_digest(
    gen: RegenerateConfig, target: str, width, batches: list[list[list[int]]], shard: int
) -> str:
    """What a shard's part files depend on: the stage's settings, the target, the shape (the
    padded width of generate() and, where fewer rows fit a call, those rows; or the static
    engine's capacity) and every batch's prompt
    tokens, in order."""
    h = hashlib.sha256(json.dumps([asdict(gen), target, width, shard], sort_keys=True).encode())
    for batch in batches:
        for ids in batch:
            h.update(repr(ids).encode())
        h.update(b"|")
    return h.hexdigest()


def regenerate_rows(rows, model, tok, gen: RegenerateConfig, budget: int, parts: PartStore,
                    max_batches: int | None = None, shard: int = 0, target: str = "",
                    engine: str = "hf") -> tuple[list[dict], Counter, bool]:  # fmt: skip
    """Generate `samples_per_prompt` answers for each of `rows` on `engine` ("static": the
    batched engine, "hf": generate()), saving a part file every `save_every` answers (hf:
    prompts); returns (rows, stats, finished). Stops at a part boundary once `max_batches`
    batches (static: part files) have run. `target` (the target's identity) joins the plan."""
    eot = end_of_turn_ids(tok)
    t = time.perf_counter()
    prompts = encode_prompts(tok, [r["messages"] for r in rows], gen.enable_thinking)
    log.info("%d prompts encoded in %.1f s", len(prompts), time.perf_counter() - t)
    longest = min(budget - 1, gen.max_prompt_tokens or budget)
    keep = [i for i, p in enumerate(prompts) if len(p) <= longest]
    stats = Counter(prompt_too_long=len(rows) - len(keep))
    by_length = plan_batches([len(prompts[i]) for i in keep], gen.batch_size)
    batches = [[keep[i] for i in b] for b in by_length]
    args = (rows, prompts, batches, gen, eot, parts, max_batches, shard, target)
    done = decode_static(model, *args) if engine == "static" else decode_hf(model, tok, *args)
    if not done:
        return [], stats, False
    saved, part_stats = parts.load()
    stats.update(part_stats)  # update keeps zero counts (Counter + drops them)
    return dedupe_answers(saved, stats), stats, True


def decode_hf(model, tok, rows, prompts, batches, gen, eot, parts, max_batches, shard, target
              ) -> bool:  # fmt: skip
    """generate() over the length-sorted `batches`, each answer index s in turn; a part file
    per save_every // batch_size batches. False when stopped by max_batches."""
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else min(eot)
    kinds = {sampled(gen, s) for s in range(gen.samples_per_prompt)}
    configs = {kind: generation_config(gen, eot, pad_id, model.device, kind) for kind in kinds}
    keep = [i for b in batches for i in b]
    # With a static cache every batch takes the shard's widest shape: one compiled decode graph
    # serves them all (transformers also sizes the cache for the longest call so far, so a
    # narrower batch would not decode faster anyway).
    static = next(iter(configs.values())).cache_implementation == "static"
    width = padded_shape([len(prompts[i]) for i in keep], 1)[1] if static and keep else 0
    try:  # refused before anything is decoded; fewer rows per call where the batch would not fit
        widest = width or padded_shape([len(prompts[i]) for i in keep] or [1], 1)[1]
        max_rows = fitting_rows(model, gen.batch_size, widest, gen.max_new_tokens)
    except ValueError as e:
        raise ConfigError(f"regenerate.batch_size {gen.batch_size}: {e}") from None
    # calls of fewer rows draw sampled answers (and round bf16 ones) otherwise: part of the plan
    shape = width if max_rows >= gen.batch_size else [width, max_rows]
    parts.bind(plan_digest(gen, target, shape, [[prompts[i] for i in b] for b in batches], shard))
    per_part = max(1, gen.save_every // gen.batch_size)
    done = parts.done()
    # part files are numbered by their first batch, answer s's batches after answer s-1's
    todo = [
        (s, k)
        for s in range(gen.samples_per_prompt)
        for k in range(0, len(batches), per_part)
        if s * len(batches) + k not in done
    ]
    total = len(keep) * gen.samples_per_prompt
    if done:
        log.info("resuming: %d of %d part files already done in %s", len(done),
                 len(todo) + len(done), parts.dir)  # fmt: skip
    bar = tqdm(total=total, desc="regenerate", unit=" answer", mininterval=2)
    bar.update(total - sum(len(b) for _, k in todo for b in batches[k : k + per_part]))
    ran, new_tokens, start = 0, 0, time.perf_counter()
    for sample, first in todo:
        if max_batches is not None and ran >= max_batches:
            bar.close()
            return False
        answered = []
        for b, batch in enumerate(batches[first : first + per_part], start=first):
            t = time.perf_counter()
            if sampled(gen, sample):
                torch.manual_seed(batch_seed(gen.seed, shard, sample, b))
            answers = generate_batch(model, [prompts[i] for i in batch],
                                     configs[sampled(gen, sample)], eot, gen.batch_size, width,
                                     max_rows)  # fmt: skip
            made = sum(len(new) for new, _ in answers)
            shape = padded_shape([len(prompts[i]) for i in batch], gen.batch_size, width)
            log.info("batch of %d prompts, shape %s: %d new tokens in %.1f s", len(batch), shape,
                     made, time.perf_counter() - t)  # fmt: skip
            answered += [(sample, i, *a) for i, a in zip(batch, answers, strict=True)]
            new_tokens += made
            ran += 1
            faults.point("regenerate.batch")
            bar.update(len(batch))
            bar.set_postfix(tok_s=f"{new_tokens / (time.perf_counter() - start):.0f}")
        parts.save(sample * len(batches) + first, *part_rows(rows, prompts, answered))
    bar.close()
    return True


def answer_seed(seed: int, prompt_id: str, sample: int) -> int:
    """The sampling generator's seed of answer `sample` to a prompt (the static engine): fixed by
    the prompt and the answer index, not by the slot, batch, shard or run it is decoded in."""
    key = repr((seed, prompt_id, sample)).encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


def engine_request(rows: list[dict], prompts: list[list[int]], gen: RegenerateConfig,
                   sample: int, i: int):  # fmt: skip
    """The batched engine's request for answer `sample` to prompt i, named by its sample id."""
    from dflashpipe.decoding.batched import Request

    prompt_id = rows[i]["prompt_id"]
    seed = answer_seed(gen.seed, prompt_id, sample) if sampled(gen, sample) else None
    return Request(f"{prompt_id}-{sample}", prompts[i], seed)


def decode_static(model, rows, prompts, batches, gen, eot, parts, max_parts, shard, target
                  ) -> bool:  # fmt: skip
    """Every answer (index s of each prompt in plan order, s by s) through the batched engine in
    one stream; part k holds answers k..k+save_every-1 of that list and is saved once they are
    all in (they finish out of order). Parts saved before are not redone; a part's answers do
    not depend on what else was decoded beside them, so a resumed shard equals a whole one.
    False when stopped after `max_parts` part files."""
    from dflashpipe.decoding.batched import BatchedEngine
    from dflashpipe.decoding.sampling import Sampling

    order = [i for b in batches for i in b]
    jobs = [(s, i) for s in range(gen.samples_per_prompt) for i in order]
    capacity = max((len(prompts[i]) for i in order), default=0) + gen.max_new_tokens
    try:  # refused before anything is written
        engine = BatchedEngine(model, gen.batch_size, capacity)
    except ValueError as e:
        raise ConfigError(f"regenerate.batch_size {gen.batch_size}: {e}") from None
    parts.bind(plan_digest(gen, target, ["static", capacity], [[prompts[i] for i in order]], shard))
    done, size = parts.done(), gen.save_every
    todo = {k: range(k, min(k + size, len(jobs))) for k in range(0, len(jobs), size)}
    todo = {k: r for k, r in todo.items() if k not in done}
    if done:
        log.info("resuming: %d of %d part files already done in %s", len(done),
                 len(todo) + len(done), parts.dir)  # fmt: skip
    if not todo:
        return True
    names = [n for r in todo.values() for n in r]  # request index -> job index
    requests = [engine_request(rows, prompts, gen, *jobs[n]) for n in names]
    sampling = Sampling(gen.temperature, gen.top_p, gen.top_k) if gen.temperature > 0 else None
    t = time.perf_counter()
    engine.prepare(sampling)  # compiling and capturing stay out of the decoding's tok/s
    log.info("static engine: %d row slots x %d cache slots, CUDA graphs %s, compiled %s; every "
             "step compiled and captured in %.1f s", engine.rows, engine.capacity, engine.graphs,
             engine.compiled, time.perf_counter() - t)  # fmt: skip
    bar = tqdm(total=len(jobs), desc="regenerate", unit=" answer", mininterval=2)
    bar.update(len(jobs) - len(names))
    answers, saved, new_tokens, start = defaultdict(dict), 0, 0, time.perf_counter()
    for a in engine.generate(requests, gen.max_new_tokens, eot, sampling):
        n = names[a.index]
        k = n - n % size
        answers[k][n] = a
        new_tokens += len(a.tokens)
        faults.point("regenerate.answer")
        bar.update(1)
        if len(answers[k]) < len(todo[k]):
            continue
        got = answers.pop(k)
        answered = [(*jobs[n], got[n].tokens, got[n].finish) for n in todo[k]]
        parts.save(k, *part_rows(rows, prompts, answered))
        saved += 1
        rate = new_tokens / (time.perf_counter() - start)
        log.info("part %d saved (%d answers); %d new tokens so far, %.0f tok/s; engine %s", k,
                 len(todo[k]), new_tokens, rate, engine.figures())  # fmt: skip
        bar.set_postfix(tok_s=f"{rate:.0f}")
        if max_parts is not None and saved >= max_parts and saved < len(todo):
            bar.close()
            return False
    bar.close()
    return True


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


def run(
    cfg: Config, prompts_path: str, shard: int, out: str, max_batches: int | None = None
) -> bool:
    """Write one sequences shard; return False if stopped early by `max_batches` (resumable)."""
    from dflashpipe.devices import stage_device
    from dflashpipe.preflight import check_before_loading
    from dflashpipe.target import load_target, load_tokenizer, target_identity

    out_path = Path(out)
    if out_path.is_file():
        PartStore(out_path).clear()  # a kill between the final rename and the cleanup
        log.info("%s is complete; not redone", out_path)
        return True
    # What extract and train would refuse (a tap on the last layer, topk beyond the vocabulary),
    # refused before the costliest stage: on a first run the target was not on disk at the
    # workflow's start, so common.smk could not check it.
    check_before_loading(cfg)
    gen = cfg.regenerate
    rows = shard_rows(Path(prompts_path), shard, gen.shards)
    budget = cfg.extract.max_length
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
        with stage_device(cfg.devices.extract, shard, "devices.extract") as device:
            log.info("shard %d: %d prompts on %s", shard, len(rows), device)
            model, tok = load_target(cfg.target, device)
            identity = target_identity(cfg.target, tok).to_json()  # hashed once: the plan's too
            seqs, stats, finished = regenerate_rows(
                rows, model, tok, gen, budget, parts, max_batches, shard, identity, engine
            )
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
