"""Regenerate's answers as one stream, whichever engine makes them.

    ShardPlan (prompts, length-sorted batches, settings)
      ├─ static_source: the batched engine (decoding/batched.py), every answer in one stream,
      │    part k = answers k..k+save_every-1 of (answer index s, then plan order); they finish
      │    out of order
      └─ hf_source: generate() on left-padded batches (decoding/hf_generate.py), answer index s
           by s, a part = save_every // batch_size batches, numbered by its first batch
      ─► Source: the part plan (part -> its answers) and answers(todo) yielding
         (part, place in the part, new tokens, finish) ─► regenerate.save_parts

A source's answers do not depend on which parts are left to do: a sampled answer's generator is
seeded by its place (engine: the prompt and answer index; generate(): the batch), so a resumed
shard's parts hold what an uninterrupted run's do.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

import torch

from dflashpipe import faults
from dflashpipe.config import RegenerateConfig
from dflashpipe.errors import ConfigError

log = logging.getLogger("dflashpipe.regenerate")

# (part number, place in the part, new tokens incl. the stop token, finish reason)
Answered = tuple[int, int, list[int], str]


@dataclass
class ShardPlan:
    """What both engines decode: `batches` of prompt indices (length-sorted, the plan's order),
    every prompt answered `gen.samples_per_prompt` times. `target` (the target's identity) and
    `shard` join the part files' digest."""

    rows: list[dict]
    prompts: list[list[int]]
    batches: list[list[int]]
    gen: RegenerateConfig
    eot: set[int]
    shard: int
    target: str

    def digest(self, shape, batches: list[list[int]]) -> str:
        """What the part files depend on: the stage's settings, the target, the engine's shape
        (generate()'s padded width and, where fewer rows fit a call, those rows; or the static
        engine's capacity) and every batch's prompt tokens (`batches` of prompt indices), in order."""
        key = [asdict(self.gen), self.target, shape, self.shard]
        h = hashlib.sha256(json.dumps(key, sort_keys=True).encode())
        for batch in batches:
            for i in batch:
                h.update(repr(self.prompts[i]).encode())
            h.update(b"|")
        return h.hexdigest()


@dataclass
class Source:
    """One engine's answers to a shard, planned into part files."""

    digest: str  # ShardPlan.digest: ties the part files to this plan
    parts: dict[int, list[tuple[int, int]]]  # part number -> (answer index, prompt index), in order
    cost: dict[int, int]  # batches a part counts for --max-batches (the engine: 1 each)
    answers: Callable[[list[int]], Iterator[Answered]]  # the parts still to do -> their answers
    figures: Callable[[], str] = str  # the engine's work so far, for the log


def sampled(gen: RegenerateConfig, sample: int) -> bool:
    """Whether answer `sample` of each prompt is sampled (else greedy)."""
    return gen.temperature > 0 and not (sample == 0 and gen.greedy_first)


def batch_seed(seed: int, shard: int, sample: int, batch: int) -> int:
    """The generator seed of one sampled batch: fixed by its place, not by what ran before."""
    key = repr((seed, shard, sample, batch)).encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


def answer_seed(seed: int, prompt_id: str, sample: int) -> int:
    """The sampling generator's seed of answer `sample` to a prompt (the static engine): fixed by
    the prompt and the answer index, not by the slot, batch, shard or run it is decoded in."""
    key = repr((seed, prompt_id, sample)).encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


def engine_request(plan: ShardPlan, sample: int, i: int):
    """The batched engine's request for answer `sample` to prompt i, named by its sample id."""
    from dflashpipe.decoding.batched import Request

    prompt_id = plan.rows[i]["prompt_id"]
    gen = plan.gen
    seed = answer_seed(gen.seed, prompt_id, sample) if sampled(gen, sample) else None
    return Request(f"{prompt_id}-{sample}", plan.prompts[i], seed)


def static_source(model, plan: ShardPlan) -> Source:
    """Every answer (index s of each prompt in plan order, s by s) through the batched engine in
    one stream; part k holds answers k..k+save_every-1 of that list. Refused (ConfigError) before
    anything is written where the rows do not fit."""
    from dflashpipe.decoding.batched import BatchedEngine
    from dflashpipe.decoding.sampling import Sampling

    gen = plan.gen
    order = [i for b in plan.batches for i in b]
    jobs = [(s, i) for s in range(gen.samples_per_prompt) for i in order]
    capacity = max((len(plan.prompts[i]) for i in order), default=0) + gen.max_new_tokens
    try:
        engine = BatchedEngine(model, gen.batch_size, capacity)
    except ValueError as e:
        raise ConfigError(f"regenerate.batch_size {gen.batch_size}: {e}") from None
    size = gen.save_every
    parts = {k: jobs[k : k + size] for k in range(0, len(jobs), size)}
    sampling = Sampling(gen.temperature, gen.top_p, gen.top_k) if gen.temperature > 0 else None

    def answers(todo: list[int]) -> Iterator[Answered]:
        names = [(k, n) for k in todo for n in range(len(parts[k]))]  # request -> (part, place)
        requests = [engine_request(plan, *parts[k][n]) for k, n in names]
        t = time.perf_counter()
        engine.prepare(sampling)  # compiling and capturing stay out of the decoding's tok/s
        log.info("static engine: %d row slots x %d cache slots, CUDA graphs %s, compiled %s; "
                 "every step compiled and captured in %.1f s", engine.rows, engine.capacity,
                 engine.graphs, engine.compiled, time.perf_counter() - t)  # fmt: skip
        for a in engine.generate(requests, gen.max_new_tokens, plan.eot, sampling):
            faults.point("regenerate.answer")
            yield (*names[a.index], a.tokens, a.finish)

    return Source(plan.digest(["static", capacity], [order]), parts, dict.fromkeys(parts, 1),
                  answers, lambda: f"engine {engine.figures()}")  # fmt: skip


def hf_source(model, tok, plan: ShardPlan) -> Source:
    """generate() over the length-sorted batches, each answer index s in turn; a part holds
    save_every // batch_size batches and is numbered s * len(batches) + its first batch. Refused
    (ConfigError) before anything is written where not one row fits."""
    from dflashpipe.decoding.hf_generate import fitting_rows, generation_config, padded_shape

    gen, prompts, batches = plan.gen, plan.prompts, plan.batches
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else min(plan.eot)
    kinds = {sampled(gen, s) for s in range(gen.samples_per_prompt)}
    configs = {kind: generation_config(gen, plan.eot, pad_id, model.device, kind) for kind in kinds}
    lengths = [len(prompts[i]) for b in batches for i in b]
    # With a static cache every batch takes the shard's widest shape: one compiled decode graph
    # serves them all (transformers also sizes the cache for the longest call so far, so a
    # narrower batch would not decode faster anyway).
    static = next(iter(configs.values())).cache_implementation == "static"
    width = padded_shape(lengths, 1)[1] if static and lengths else 0
    try:  # refused before anything is decoded; fewer rows per call where the batch would not fit
        widest = width or padded_shape(lengths or [1], 1)[1]
        max_rows = fitting_rows(model, gen.batch_size, widest, gen.max_new_tokens)
    except ValueError as e:
        raise ConfigError(f"regenerate.batch_size {gen.batch_size}: {e}") from None
    # calls of fewer rows draw sampled answers (and round bf16 ones) otherwise: part of the plan
    shape = width if max_rows >= gen.batch_size else [width, max_rows]
    per_part = max(1, gen.save_every // gen.batch_size)
    firsts = {s * len(batches) + k: (s, k) for s in range(gen.samples_per_prompt)
              for k in range(0, len(batches), per_part)}  # fmt: skip
    parts = {
        p: [(s, i) for b in batches[k : k + per_part] for i in b] for p, (s, k) in firsts.items()
    }
    cost = {p: len(batches[k : k + per_part]) for p, (s, k) in firsts.items()}

    def answers(todo: list[int]) -> Iterator[Answered]:
        for p in todo:
            sample, first = firsts[p]
            place = 0
            for b, batch in enumerate(batches[first : first + per_part], start=first):
                t = time.perf_counter()
                if sampled(gen, sample):
                    torch.manual_seed(batch_seed(gen.seed, plan.shard, sample, b))
                made = generate(batch, configs[sampled(gen, sample)])
                log.info("batch of %d prompts, shape %s: %d new tokens in %.1f s", len(batch),
                         padded_shape([len(prompts[i]) for i in batch], gen.batch_size, width),
                         sum(len(new) for new, _ in made), time.perf_counter() - t)  # fmt: skip
                faults.point("regenerate.batch")
                for new, finish in made:
                    yield p, place, new, finish
                    place += 1

    def generate(batch: list[int], config) -> list[tuple]:
        from dflashpipe.decoding.hf_generate import generate_batch

        return generate_batch(model, [prompts[i] for i in batch], config, plan.eot,
                              gen.batch_size, width, max_rows)  # fmt: skip

    return Source(plan.digest(shape, batches), parts, cost, answers)
