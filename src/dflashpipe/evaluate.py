"""Stage 6, evaluate: greedy speculative decoding with an exported drafter on held-out prompts.

    eval.parquet ─► num_prompts (round robin over sources) ─► chat template ─► fit to context
      ─► per prompt (`workers` processes side by side, each a slice of the prompts), one
         harness (speculative.py), in the target's run dtype:
           target-only greedy │ DFlash drafter │ prompt lookup (n-gram proposer, same loop)
      ─► run dtype not float32 (bf16 on GPU): bf16 agreement; target + drafter to float32,
         target-only and DFlash decoded again for the lossless check
      ─► metrics.json

tau (acceptance length) = accepted drafts + 1 per verify step, averaged per response, then over
responses (responses without a verify step, e.g. EOS first, have no tau). Speeds are decode
tokens/s (tokens after the prefill's first one over the time after the prefill), summed over
responses; speedup = speculative / target-only. The drafter is checked against the target before
any decoding: a drafter made for another target cannot be evaluated meaningfully.
"""

from __future__ import annotations

import json
import logging
import platform
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

import pyarrow.parquet as pq
import torch
import transformers
from tqdm import tqdm

from dflashpipe.chat import encode_prompt, end_of_turn_ids
from dflashpipe.config import TargetConfig
from dflashpipe.errors import ConfigError, DataError
from dflashpipe.export import CONFIG_NAME, config_from_dict, load_drafter
from dflashpipe.model import DrafterConfig
from dflashpipe.speculative import (
    Decoded,
    DFlashProposer,
    PromptLookupProposer,
    Target,
    greedy_decode,
    speculative_decode,
)
from dflashpipe.storage import write_json

log = logging.getLogger(__name__)

METHODS = ("target", "dflash", "prompt_lookup")


@dataclass
class EvaluateConfig:
    """Stage settings (the `evaluate` section; enable_thinking as regenerate's)."""

    num_prompts: int = 32
    max_new_tokens: int = 256
    prompt_lookup_num_tokens: int = 10  # transformers' usual setting
    prompt_lookup_max_ngram: int = 2  # transformers' default max_matching_ngram_size
    workers: int = 1  # processes decoding slices of the prompts side by side on the one device
    enable_thinking: bool | None = None

    def __post_init__(self) -> None:
        for name in ("num_prompts", "max_new_tokens", "prompt_lookup_num_tokens", "workers"):
            if getattr(self, name) < 1:
                raise ConfigError(f"evaluate.{name} must be >= 1, got {getattr(self, name)}")
        if self.prompt_lookup_max_ngram < 1:
            raise ConfigError(
                f"evaluate.prompt_lookup_max_ngram must be >= 1, got {self.prompt_lookup_max_ngram}"
            )


def read_drafter_config(drafter_dir: str | Path) -> DrafterConfig:
    path = Path(drafter_dir) / CONFIG_NAME
    if not path.is_file():
        raise DataError(f"{path} is missing; expected a drafter export (run the export stage)")
    return config_from_dict(json.loads(path.read_text(encoding="utf-8")), str(path))


def check_fit(drafter: DrafterConfig, target_config, origin: str) -> None:
    """Refuse a drafter made for another target, naming the field and both values."""
    tc = target_config.get_text_config()
    layers = tc.num_hidden_layers
    wrong = []
    if any(not 0 <= i < layers for i in drafter.target_layer_ids):
        wrong.append(
            f"target_layer_ids {drafter.target_layer_ids} are not all layers of the target, "
            f"which has num_hidden_layers {layers} (0..{layers - 1})"
        )
    for field, mine, theirs in (
        ("num_target_layers", drafter.num_target_layers, layers),
        ("hidden_size", drafter.hidden_size, tc.hidden_size),
        ("vocab_size", drafter.vocab_size, tc.vocab_size),
    ):
        if mine != theirs:
            wrong.append(f"{field} is {mine} in the drafter but {theirs} in the target")
    if wrong:
        raise DataError(f"{origin} does not fit the target: " + "; ".join(wrong))


def read_eval_prompts(path: str | Path, num_prompts: int) -> list[dict]:
    """The first num_prompts rows, taken round robin over sources so each one is represented."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"eval prompt table not found: {path}")
    rows = pq.read_table(path).to_pylist()
    if not rows:
        raise DataError(f"{path} holds no prompts; nothing to evaluate (check prompts.sources)")
    missing = {"prompt_id", "source", "messages"} - set(rows[0])
    if missing:
        raise DataError(f"{path} lacks column(s) {sorted(missing)} of a prompts table")
    by_source: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        by_source[r["source"]].append(r)
    queues = [iter(q) for q in by_source.values()]
    picked: list[dict] = []
    while queues and len(picked) < num_prompts:
        for q in list(queues):
            if (r := next(q, None)) is None:
                queues.remove(q)
            elif len(picked) < num_prompts:
                picked.append(r)
    return picked


def encode_rows(
    rows: list[dict], tok, ev: EvaluateConfig, context: int, block: int, skipped: Counter
) -> list[tuple[dict, list[int]]]:
    """(row, prompt ids) of the prompts whose answer and last block fit in `context` positions."""
    out = []
    for r in rows:
        try:
            ids = encode_prompt(tok, r["messages"], ev.enable_thinking)
        except DataError as e:
            skipped["template_error"] += 1
            log.warning("prompt %s skipped: %s", r["prompt_id"], e)
            continue
        if len(ids) + ev.max_new_tokens + block > context:
            skipped["prompt_too_long"] += 1
            log.warning(
                "prompt %s skipped: %d tokens + max_new_tokens %d + block %d > context %d",
                r["prompt_id"],
                len(ids),
                ev.max_new_tokens,
                block,
                context,
            )
            continue
        out.append((r, ids))
    return out


def decode_all(
    target: Target,
    proposers: dict,
    prompts: list[tuple[dict, list[int]]],
    max_new_tokens: int,
    stop_ids: set[int],
    desc: str,
) -> dict[str, list[Decoded]]:
    """Every method on every prompt, interleaved per prompt so drift in machine speed hits all
    methods alike; one untimed warm-up response first (allocator, kernels, lazy inits)."""
    methods = ["target", *proposers]

    def decode(method: str, ids: list[int], n: int) -> Decoded:
        if method == "target":
            return greedy_decode(target, ids, n, stop_ids)
        return speculative_decode(target, proposers[method], ids, n, stop_ids)

    for method in methods:
        decode(method, prompts[0][1], min(max_new_tokens, 8))
    results: dict[str, list[Decoded]] = {m: [] for m in methods}
    for _, ids in tqdm(prompts, desc=desc, unit=" prompt"):
        for method in methods:
            results[method].append(decode(method, ids, max_new_tokens))
    return results


def first_divergence(
    prompts: list[tuple[dict, list[int]]], ref: list[Decoded], got: list[Decoded]
) -> dict | None:
    """Where the first speculative output that is not the target's own departs from it."""
    for (row, _), a, b in zip(prompts, ref, got, strict=True):
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
    return {
        "acceptance_length": _mean(taus),
        "decode_tokens_per_s": sum(r.decode_tokens for r in results) / decode_s if decode_s else 0,
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


def summarize(
    prompts: list[tuple[dict, list[int]]],
    main: dict[str, list[Decoded]],
    lossless: tuple[list[Decoded], list[Decoded]],
    block: int,
    lookup_tokens: int,
    reduced_precision: bool,
) -> dict:
    """metrics.json's figures: main holds the timed run-dtype responses per method, lossless
    the float32 (target-only, speculative) pair."""
    target, dflash, looked_up = main["target"], main["dflash"], main["prompt_lookup"]
    spec, base = method_summary(dflash, block - 1), method_summary(target, block - 1)
    lookup = method_summary(looked_up, lookup_tokens)
    base_speed = base["decode_tokens_per_s"]
    histogram = Counter(a for r in dflash for a in r.accepted_lengths)
    same = _identical(*lossless)
    responses = [
        {
            "prompt_id": row["prompt_id"],
            "source": row["source"],
            "prompt_tokens": len(ids),
            "new_tokens": len(r.output_ids),
            "finish_reason": r.finish_reason,
            "acceptance_length": r.acceptance_length,
            "prompt_lookup_acceptance_length": p.acceptance_length,
            "lossless": ok,
        }
        for (row, ids), r, p, ok in zip(prompts, dflash, looked_up, same, strict=True)
    ]
    return {
        "acceptance_length": spec["acceptance_length"],
        "per_source": tau_per_source(prompts, dflash),
        "histogram": {str(k): histogram.get(k, 0) for k in range(1, block + 1)},
        "per_position_acceptance": spec["per_position_acceptance"],
        "lossless_fraction": sum(same) / len(same),
        "first_divergence": first_divergence(prompts, *lossless),
        "bf16_agreement": _mean(_identical(target, dflash)) if reduced_precision else None,
        "speedup": spec["decode_tokens_per_s"] / base_speed if base_speed else None,
        "tokens_per_s": {
            "speculative": spec["decode_tokens_per_s"],
            "target_only": base_speed,
            "speculative_with_prefill": spec["tokens_per_s"],
            "target_only_with_prefill": base["tokens_per_s"],
        },
        "verify_steps": spec["verify_steps"],
        "baseline": {
            "prompt_lookup": {
                "method": "n-gram prompt-lookup proposer (transformers' candidate rule) run "
                "through the same verify loop and harness as the drafter",
                "num_tokens": lookup_tokens,
                "acceptance_length": lookup["acceptance_length"],
                "per_source": tau_per_source(prompts, looked_up),
                "tokens_per_s": lookup["decode_tokens_per_s"],
                "speedup": lookup["decode_tokens_per_s"] / base_speed if base_speed else None,
                "per_position_acceptance": lookup["per_position_acceptance"],
                "identical_to_target_fraction": _mean(_identical(target, looked_up)),
                "dflash_ahead": ahead_per_source(prompts, dflash, looked_up),
            }
        },
        "responses": responses,
    }


def load_models(target_cfg: TargetConfig, drafter_dir: str | Path, device: torch.device):
    """(target model, tokenizer, drafter) on device in the target's dtype; the drafter is
    checked against the target before its weights are loaded."""
    from dflashpipe.target import load_target

    drafter_cfg = read_drafter_config(drafter_dir)
    model, tok = load_target(target_cfg, device)
    check_fit(drafter_cfg, model.config, str(Path(drafter_dir) / CONFIG_NAME))
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    drafter = load_drafter(drafter_dir, embed, embed if head is None else head.weight, device)
    return model, tok, drafter.to(model.dtype).eval()


Responses = tuple[dict[str, list[Decoded]], tuple[list[Decoded], list[Decoded]]]


def decode_and_check(
    model, drafter, prompts: list[tuple[dict, list[int]]], ev: EvaluateConfig, stop_ids: set[int],
    worker: str = "",
) -> Responses:  # fmt: skip
    """(timed responses per method in the run dtype, float32 (target-only, DFlash) pair)."""
    target = Target(model, drafter.config.target_layer_ids)
    dflash = DFlashProposer(drafter)
    lookup = PromptLookupProposer(ev.prompt_lookup_num_tokens, ev.prompt_lookup_max_ngram)
    n = ev.max_new_tokens
    try:
        main = decode_all(target, {"dflash": dflash, "prompt_lookup": lookup}, prompts, n,
                          stop_ids, f"evaluate{worker}")  # fmt: skip
        if model.dtype == torch.float32:
            return main, (main["target"], main["dflash"])
        # bf16 rounds a block forward and one-token forwards differently, so near-tied argmaxes
        # flip: losslessness is a float32 property, checked in float32.
        model.float()
        drafter.float()
        fp32 = decode_all(target, {"dflash": dflash}, prompts, n, stop_ids, f"float32{worker}")
        return main, (fp32["target"], fp32["dflash"])
    finally:
        target.close()


def _decode_slice(target_cfg: TargetConfig, drafter_dir: str, device: str, prompts: list,
                  ev: EvaluateConfig, stop_ids: set[int], worker: str) -> Responses:  # fmt: skip
    """One worker process: its own copy of the models, one slice of the prompts."""
    torch.set_num_threads(1)  # the processes share the machine's cores
    model, _, drafter = load_models(target_cfg, drafter_dir, torch.device(device))
    return decode_and_check(model, drafter, prompts, ev, stop_ids, worker)


def decode_in_workers(
    model, drafter, prompts: list[tuple[dict, list[int]]], ev: EvaluateConfig, stop_ids: set[int],
    target_cfg: TargetConfig, drafter_dir: str | Path,
) -> Responses:  # fmt: skip
    """decode_and_check over `ev.workers` processes on the same device, prompt k in slice
    k % workers; this process decodes slice 0 with the models it holds. Decoding one sequence is
    bound by Python and kernel launches, so side by side the slices share the device well; every
    process still interleaves the methods per prompt, so speed ratios compare like with like."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    workers = min(ev.workers, len(prompts))
    if workers == 1:
        return decode_and_check(model, drafter, prompts, ev, stop_ids)
    slices = [prompts[k::workers] for k in range(workers)]
    with ProcessPoolExecutor(workers - 1, mp_context=get_context("spawn")) as pool:
        args = (target_cfg, str(drafter_dir), str(model.device))
        futures = [
            pool.submit(_decode_slice, *args, part, ev, stop_ids, f" [{k}/{workers}]")
            for k, part in enumerate(slices[1:], start=1)
        ]
        parts = [decode_and_check(model, drafter, slices[0], ev, stop_ids, f" [0/{workers}]")]
        parts += [f.result() for f in futures]

    def merged(lists: list[list[Decoded]]) -> list[Decoded]:
        out: list[Decoded] = [None] * len(prompts)  # type: ignore[list-item]
        for k, part in enumerate(lists):
            out[k::workers] = part
        return out

    main = {m: merged([p[0][m] for p in parts]) for m in parts[0][0]}
    lossless = (merged([p[1][0] for p in parts]), merged([p[1][1] for p in parts]))
    return main, lossless


def run_info(
    target_cfg: TargetConfig,
    drafter_dir,
    cfg: DrafterConfig,
    device: torch.device,
    run_dtype: torch.dtype,
) -> dict:
    return {
        "drafter": {
            "path": str(drafter_dir),
            "block_size": cfg.block_size,
            "target_layer_ids": cfg.target_layer_ids,
        },
        "target": target_cfg.model + (f"/{target_cfg.gguf_file}" if target_cfg.gguf_file else ""),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "run_dtype": str(run_dtype).removeprefix("torch."),
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
        },
    }


def run(
    target_cfg: TargetConfig,
    drafter_dir: str | Path,
    prompts_path: str | Path,
    out: str | Path,
    ev: EvaluateConfig,
    device: torch.device | str | None = None,
) -> dict:
    """Evaluate the drafter export in drafter_dir against the target; write and return metrics."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    rows = read_eval_prompts(prompts_path, ev.num_prompts)
    model, tok, drafter = load_models(target_cfg, drafter_dir, device)
    run_dtype, cfg = model.dtype, drafter.config
    context = min(
        model.config.get_text_config().max_position_embeddings, cfg.max_position_embeddings
    )
    skipped: Counter = Counter(prompt_too_long=0, template_error=0)
    prompts = encode_rows(rows, tok, ev, context, cfg.block_size, skipped)
    if not prompts:
        raise DataError(
            f"none of the {len(rows)} eval prompts of {prompts_path} can be decoded "
            f"(skipped: {dict(skipped)}); the context is {context} tokens"
        )
    log.info("%d prompts on %s in %s, %d worker process(es) (skipped %s)", len(prompts), device,
             run_dtype, min(ev.workers, len(prompts)), dict(skipped))  # fmt: skip
    main, lossless = decode_in_workers(
        model, drafter, prompts, ev, end_of_turn_ids(tok), target_cfg, drafter_dir
    )
    metrics = summarize(
        prompts,
        main,
        lossless,
        cfg.block_size,
        ev.prompt_lookup_num_tokens,
        reduced_precision=run_dtype != torch.float32,
    )
    metrics |= {"num_prompts": len(prompts), "skipped": dict(skipped), "settings": asdict(ev)}
    metrics |= run_info(target_cfg, drafter_dir, cfg, device, run_dtype)
    if metrics["lossless_fraction"] < 1.0:
        log.error("speculative output differs from greedy: %s", metrics["first_divergence"])
    write_json(out, metrics)
    log.info(
        "tau %s, speedup %s, lossless %.2f, prompt lookup tau %s -> %s",
        metrics["acceptance_length"],
        metrics["speedup"],
        metrics["lossless_fraction"],
        metrics["baseline"]["prompt_lookup"]["acceptance_length"],
        out,
    )
    return metrics
