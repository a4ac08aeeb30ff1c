"""metrics.json's figures from decoded responses (evaluate.py decodes, this counts).

    responses per method ──► method_summary   tau, decode tokens/s, per-position acceptance
      (run dtype, timed)  ├► tau_per_source, ahead_per_source (paired per prompt vs lookup)
                          └► method_rows      every method's tau / speed / speedup, DDTree's
                                              per budget (`methods`, `ddtree`)
    float32 responses ───► lossless fraction and first divergence, per speculative method

tau (acceptance length) = accepted drafts + 1 per verify step, averaged per response, then over
responses (responses without a verify step have no tau). Speeds are decode tokens/s summed over
responses; speedup = a method's speed / the target-only speed of the same engine and process.
"""

from __future__ import annotations

from collections import Counter, defaultdict

from dflashpipe.decoding.lookup import LookupConfig
from dflashpipe.decoding.types import Decoded


def first_divergence(
    prompts: list[tuple[dict, list[int]]], ref: list[Decoded], got: list[Decoded]
) -> dict | None:
    """Where the first speculative output that is not the target's own departs from it."""
    for (row, _), a, b in zip(prompts[: len(ref)], ref, got, strict=True):
        if a.output_ids == b.output_ids:
            continue
        pairs = zip(a.output_ids, b.output_ids, strict=False)
        pos = next((i for i, (x, y) in enumerate(pairs) if x != y), None)
        pos = min(len(a.output_ids), len(b.output_ids)) if pos is None else pos
        return {
            "prompt_id": row["prompt_id"],
            "source": row["source"],
            "position": pos,
            "target_token": a.output_ids[pos] if pos < len(a.output_ids) else None,
            "speculative_token": b.output_ids[pos] if pos < len(b.output_ids) else None,
        }
    return None


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _identical(a: list[Decoded], b: list[Decoded]) -> list[bool]:
    return [x.output_ids == y.output_ids for x, y in zip(a, b, strict=True)]


def method_summary(results: list[Decoded], num_positions: int) -> dict:
    """tau, decode speed and per-position acceptance of one method over all responses."""
    taus = [t for r in results if (t := r.acceptance_length) is not None]
    decode_s = sum(r.decode_s for r in results)
    wall_s = sum(r.wall_s for r in results)
    accepted, proposed = [0] * num_positions, [0] * num_positions
    for r in results:
        a, p = r.position_counts(num_positions)
        accepted = [x + y for x, y in zip(accepted, a, strict=True)]
        proposed = [x + y for x, y in zip(proposed, p, strict=True)]
    tokens = sum(r.decode_tokens for r in results)
    steps = sum(len(r.accepted_lengths) or r.decode_tokens for r in results)  # greedy: 1 per token
    return {
        "acceptance_length": _mean(taus),
        "decode_tokens_per_s": tokens / decode_s if decode_s else 0,
        # Pooled over all steps, unlike tau (the mean of per-prompt means): decode tokens per
        # step and seconds per step, so that speedup = tokens_per_step / step_cost exactly.
        "tokens_per_step": tokens / steps if steps else None,
        "seconds_per_step": decode_s / steps if steps else None,
        "tokens_per_s": sum(len(r.output_ids) for r in results) / wall_s if wall_s else 0,
        "verify_steps": sum(len(r.accepted_lengths) for r in results),
        "per_position_acceptance": [
            a / p if p else None for a, p in zip(accepted, proposed, strict=True)
        ],
    }


def tau_per_source(prompts: list[tuple[dict, list[int]]], results: list[Decoded]) -> dict:
    """Mean acceptance length of one method's responses, per eval source."""
    by_source: dict[str, list[float]] = defaultdict(list)
    for (row, _), r in zip(prompts, results, strict=True):
        if r.acceptance_length is not None:
            by_source[row["source"]].append(r.acceptance_length)
    return {s: _mean(v) for s, v in sorted(by_source.items())}


def ahead_per_source(
    prompts: list[tuple[dict, list[int]]], ours: list[Decoded], theirs: list[Decoded]
) -> dict:
    """Per eval source, on how many prompts (of those where both methods verified a draft) our
    acceptance length is above, equal to and below theirs: a paired view the means hide."""
    counts: dict[str, dict[str, int]] = defaultdict(lambda: {"ahead": 0, "tied": 0, "behind": 0})
    for (row, _), a, b in zip(prompts, ours, theirs, strict=True):
        if a.acceptance_length is not None and b.acceptance_length is not None:
            d = a.acceptance_length - b.acceptance_length
            counts[row["source"]]["ahead" if d > 0 else "behind" if d < 0 else "tied"] += 1
    return dict(sorted(counts.items()))


def _ratio(x: float | None, base: float | None) -> float | None:
    """x over the target-only figure `base`: speedup (decode tokens/s) or step cost (seconds
    per step, a target-only step being one token); None where either is missing."""
    return None if x is None or not base else x / base


def method_rows(
    prompts: list[tuple[dict, list[int]]], main: dict[str, list[Decoded]],
    lossless: dict[str, list[Decoded]], engine: str,
) -> tuple[dict, dict]:  # fmt: skip
    """(metrics' `methods`, `ddtree` per budget): tau, decode speed, speedup against the
    target-only of the same engine and float32 losslessness."""
    methods, trees = {}, {}
    base = method_summary(main["target"], 0)
    for m, results in main.items():
        row = method_summary(results, 0)
        entry = {
            "engine": engine,
            "acceptance_length": row["acceptance_length"],
            "decode_tokens_per_s": row["decode_tokens_per_s"],
            "speedup": _ratio(row["decode_tokens_per_s"], base["decode_tokens_per_s"]),
            "speedup_against": "target",
            "tokens_per_step": row["tokens_per_step"],
            "step_cost": _ratio(row["seconds_per_step"], base["seconds_per_step"]),
        }
        if m in lossless and m != "target":
            same = _identical(lossless["target"], lossless[m])  # the checked prompts: the first
            entry["lossless_fraction"] = sum(same) / len(same)
        if not m.startswith("ddtree@"):
            methods[m] = entry
            continue
        entry |= {
            "per_source": tau_per_source(prompts, results),
            "verify_steps": row["verify_steps"],
            "nodes_per_step": _mean([d for r in results for d in r.drafted]),
            "first_divergence": (
                first_divergence(prompts, lossless["target"], lossless[m]) if lossless else None
            ),
        }
        trees[m.removeprefix("ddtree@")] = entry
    return methods, trees


def summarize(
    prompts: list[tuple[dict, list[int]]],
    main: dict[str, list[Decoded]],
    lossless: dict[str, list[Decoded]],
    block: int,
    lookup: LookupConfig,
    reduced_precision: bool,
    engine: dict | None = None,
    lookup_sweep: dict[str, list[Decoded]] | None = None,
) -> dict:
    """metrics.json's figures: main holds the timed run-dtype responses per method, lossless
    the float32 ones of target-only, DFlash and DDTree ({} when unchecked: the lossless figures
    are then None); `engine` is Decoders.info(); `lookup`
    the configured (timed) prompt lookup, `lookup_sweep` lookup.sweep's replays by name."""
    engine = engine or {"kind": "eager", "graphs": False, "compiled": False}
    target, dflash, looked_up = main["target"], main["dflash"], main.get("prompt_lookup")
    spec, base = method_summary(dflash, block - 1), method_summary(target, block - 1)
    base_speed = base["decode_tokens_per_s"]
    histogram = Counter(a for r in dflash for a in r.accepted_lengths)
    checked = bool(lossless)
    same = _identical(lossless["target"], lossless["dflash"]) if checked else []
    per_response = same + [None] * (len(dflash) - len(same))  # None: not checked
    trees = {m.removeprefix("ddtree@"): main[m] for m in main if m.startswith("ddtree@")}
    responses = []
    for k, ((row, ids), r, ok) in enumerate(zip(prompts, dflash, per_response, strict=True)):
        responses.append({
            "prompt_id": row["prompt_id"],
            "source": row["source"],
            "prompt_tokens": len(ids),
            "new_tokens": len(r.output_ids),
            "finish_reason": r.finish_reason,
            "acceptance_length": r.acceptance_length,
            "lossless": ok,
        })  # fmt: skip
        if looked_up is not None:
            responses[-1]["prompt_lookup_acceptance_length"] = looked_up[k].acceptance_length
        if trees:
            responses[-1]["ddtree_acceptance_length"] = {
                n: results[k].acceptance_length for n, results in trees.items()
            }
    methods, ddtree = method_rows(prompts, main, lossless, engine["kind"])
    metrics = {
        "acceptance_length": spec["acceptance_length"],
        "per_source": tau_per_source(prompts, dflash),
        "histogram": {str(k): histogram.get(k, 0) for k in range(1, block + 1)},
        "per_position_acceptance": spec["per_position_acceptance"],
        "lossless_fraction": sum(same) / len(same) if checked else None,
        "lossless_prompts": len(same) if checked else 0,
        "first_divergence": (
            first_divergence(prompts, lossless["target"], lossless["dflash"]) if checked else None
        ),
        "bf16_agreement": _mean(_identical(target, dflash)) if reduced_precision else None,
        "speedup": _ratio(spec["decode_tokens_per_s"], base_speed),
        "tokens_per_s": {
            "speculative": spec["decode_tokens_per_s"],
            "target_only": base_speed,
            "speculative_with_prefill": spec["tokens_per_s"],
            "target_only_with_prefill": base["tokens_per_s"],
        },
        "verify_steps": spec["verify_steps"],
        "baseline": {},
        "methods": methods,
        "ddtree": ddtree,
        "engine": engine,
        "responses": responses,
    }
    if looked_up is not None:
        baseline = lookup_baseline(prompts, dflash, looked_up, lookup, lookup_sweep or {})
        configured = methods["prompt_lookup"]
        timed = methods.get("prompt_lookup_best", configured)
        which = (
            "each prompt decoded again with its source's best configuration (of its worker's "
            "slice when evaluate.workers > 1)"
            if "prompt_lookup_best" in methods
            else "the configured one's"
        )
        baseline |= {
            "method": "n-gram prompt lookup: the best configuration per source of a sweep "
            f"replayed on the target-only outputs; speed and speedup are {which}, decoded "
            f"through the same engine as the drafter ({engine['kind']})",
            "tokens_per_s": timed["decode_tokens_per_s"],
            "speedup": timed["speedup"],
            "speedup_against": timed["speedup_against"],
            "configured_tokens_per_s": configured["decode_tokens_per_s"],
            "configured_speedup": configured["speedup"],
            "identical_to_target_fraction": _mean(_identical(target, looked_up)),
        }
        if "prompt_lookup_best" in main:  # decoded: the last step may accept past the replay
            baseline["timed_per_source"] = tau_per_source(prompts, main["prompt_lookup_best"])
        best = baseline.pop("best_responses")
        for response, r in zip(responses, best, strict=True):
            response["prompt_lookup_acceptance_length"] = r.acceptance_length
        baseline["dflash_ahead"] = ahead_per_source(prompts, dflash, best)
        metrics["baseline"]["prompt_lookup"] = baseline
    return metrics


def best_per_source(
    prompts: list[tuple[dict, list[int]]], runs: dict[str, list[Decoded]]
) -> dict[str, str]:
    """Per eval source, the name of the run (e.g. a prompt-lookup configuration) with the
    highest mean acceptance length there; the first listed wins a tie."""
    taus = {name: tau_per_source(prompts, results) for name, results in runs.items()}
    sources = sorted({row["source"] for row, _ in prompts})

    def tau(name: str, source: str) -> float:
        t = taus[name].get(source)
        return -1.0 if t is None else t

    return {s: max(runs, key=lambda name: tau(name, s)) for s in sources}


def lookup_baseline(
    prompts: list[tuple[dict, list[int]]], dflash: list[Decoded], timed: list[Decoded],
    configured: LookupConfig, swept: dict[str, list[Decoded]],
) -> dict:  # fmt: skip
    """Prompt lookup at its best: per source the configuration (of the sweep, and the timed
    configured one) with the highest tau there. `best_responses` holds, per prompt, the responses
    of its source's best configuration (the paired counts against DFlash use them)."""
    runs = {configured.name + " (timed)": timed} | swept
    rows = [
        {
            "config": name,
            "acceptance_length": method_summary(results, 0)["acceptance_length"],
            "per_source": tau_per_source(prompts, results),
        }
        for name, results in runs.items()
    ]
    by_name = {row["config"]: row for row in rows}
    best = {s: by_name[name] for s, name in best_per_source(prompts, runs).items()}
    overall = max(rows, key=lambda row: row["acceptance_length"] or -1.0)
    pick = {s: runs[row["config"]] for s, row in best.items()}
    return {
        "configured": configured.name,
        "num_tokens": configured.num_drafts,
        "best": overall["config"],
        "acceptance_length": overall["acceptance_length"],
        "best_per_source": {s: row["config"] for s, row in best.items()},
        "per_source": {s: row["per_source"].get(s) for s, row in best.items()},
        "configured_acceptance_length": rows[0]["acceptance_length"],
        "configured_per_source": rows[0]["per_source"],
        "per_position_acceptance": method_summary(
            runs[overall["config"]],
            max((d for r in runs[overall["config"]] for d in r.drafted), default=0),
        )["per_position_acceptance"],
        "sweep": rows[1:],
        "best_responses": [pick[row["source"]][k] for k, (row, _) in enumerate(prompts)],
    }
