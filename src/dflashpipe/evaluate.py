"""Stage 6, evaluate: greedy speculative decoding with an exported drafter on held-out prompts.

    eval.parquet ─► num_prompts (round robin over sources) ─► chat template (a base model:
      plain text, chat.py) ─► fit to context
      ─► per prompt (`workers` processes side by side, each a slice of the prompts), one
         engine per process (decoding/runner.py: the static engine, or the eager loop), run
         dtype:
           target-only greedy │ DFlash drafter │ DDTree per tree_nodes budget │ prompt lookup
      ─► prompt lookup's grid replayed on this process's target-only outputs; each prompt
         decoded again with its source's best configuration (`prompt_lookup_best`, timed)
      ─► run dtype not float32 (bf16 on GPU): bf16 agreement; target + drafter to float32,
         target-only, DFlash and DDTree decoded again for the lossless check
      ─► prompt lookup's grid (decoding/lookup.py GRID) replayed on the target-only outputs:
         every configuration's tau per source, the best per source is the baseline
      ─► evaluate.concurrency with a level c > 1, before all of the above: every prompt
         decoded c at a time (decoding/concurrent.py, continuous refill) for each level and
         c = 1, target-only, DFlash and prompt lookup: `concurrency` in metrics.json
      ─► metrics.json: DFlash's figures at the top level (as before), every method's tau,
         speed and speedup in `methods`, DDTree's per budget in `ddtree`, the engine in `engine`,
         the target's resolved attention and prompt format (`attn_implementation`, `prompt_format`)

tau (acceptance length) = accepted drafts + 1 per verify step, averaged per response, then over
responses (responses without a verify step, e.g. EOS first, have no tau). Speeds are decode
tokens/s (tokens after the prefill's first one over the time after the prefill), summed over
responses; speedup = speculative / target-only in the same engine and process (prompt lookup is
an engine step too: its configured setting and each source's best are decoded and timed, the
others only replayed, which gives the same acceptances since decoding is greedy). The drafter is checked against the target
before any decoding: a drafter made for another target cannot be evaluated meaningfully.
"""

from __future__ import annotations

import json
import logging
import platform
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

import pyarrow.parquet as pq
import torch
import transformers

from dflashpipe.chat import encode_prompt, end_of_turn_ids, prompt_format
from dflashpipe.config import Config, EvaluateConfig, TargetConfig
from dflashpipe.decoding.concurrent import ConcurrentEngine, check_rows
from dflashpipe.decoding.engine import Engine
from dflashpipe.decoding.families import check_target
from dflashpipe.decoding.lookup import GRID, LookupConfig, sweep
from dflashpipe.decoding.runner import Decoders
from dflashpipe.decoding.summary import _mean, best_per_source, summarize
from dflashpipe.decoding.types import Decoded
from dflashpipe.devices import ANY_DEVICE, DeviceLease
from dflashpipe.errors import ConfigError, DataError
from dflashpipe.export import CONFIG_NAME, config_from_dict, load_drafter
from dflashpipe.model import DrafterConfig, input_embedding_scale
from dflashpipe.storage import write_json

log = logging.getLogger(__name__)


def configured_lookup(ev: EvaluateConfig) -> LookupConfig:
    """The configured (timed) prompt lookup."""
    return LookupConfig(
        ev.prompt_lookup_num_tokens, ev.prompt_lookup_max_ngram,
        ev.prompt_lookup_occurrence, ev.prompt_lookup_search,
    )  # fmt: skip


def slack(ev: EvaluateConfig, block_size: int) -> int:
    """EvaluateConfig.slack with prompt lookup's grid: its best configurations may draft more
    than the configured one (16 against 10), which overran the engine's buffers once DDTree's
    larger steps no longer widened them."""
    return ev.slack(block_size, max(c.num_drafts for c in GRID))


def engine_length(
    prompts: list[tuple[dict, list[int]]], ev: EvaluateConfig, block_size: int
) -> int:
    """An engine's max_len for these prompts: the longest, its new tokens and a step's slack."""
    return max(len(ids) for _, ids in prompts) + ev.max_new_tokens + slack(ev, block_size)


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
    for name, mine, theirs in (
        ("num_target_layers", drafter.num_target_layers, layers),
        ("hidden_size", drafter.hidden_size, tc.hidden_size),
        ("vocab_size", drafter.vocab_size, tc.vocab_size),
    ):
        if mine != theirs:
            wrong.append(f"{name} is {mine} in the drafter but {theirs} in the target")
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
    """(row, prompt ids) of the prompts whose answer and last step fit in `context` positions
    (`block`: the slack of the largest step, EvaluateConfig.slack)."""
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
                "prompt %s skipped: %d tokens + max_new_tokens %d + step %d > context %d",
                r["prompt_id"],
                len(ids),
                ev.max_new_tokens,
                block,
                context,
            )
            continue
        out.append((r, ids))
    return out


def load_models(target_cfg: TargetConfig, drafter_dir: str | Path, device: torch.device):
    """(target model, tokenizer, drafter) on device in the target's dtype; the drafter is
    checked against the target before its weights are loaded."""
    from dflashpipe.target import load_target

    drafter_cfg = read_drafter_config(drafter_dir)
    model, tok = load_target(target_cfg, device)
    check_fit(drafter_cfg, model.config, str(Path(drafter_dir) / CONFIG_NAME))
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    drafter = load_drafter(drafter_dir, embed, embed if head is None else head.weight, device,
                           input_embedding_scale(model))  # fmt: skip
    return model, tok, drafter.to(model.dtype).eval()


@dataclass
class Responses:
    """What decode_and_check gives for one process's prompts (decode_in_workers: for all)."""

    timed: dict[str, list[Decoded]]  # per method, in the run dtype, timed
    lossless: dict[
        str, list[Decoded]
    ]  # target-only, DFlash, DDTree per budget in float32 ({}: off)
    engine: dict  # the engine used: Decoders.info()
    swept: dict[str, list[Decoded]]  # prompt lookup's sweep replays by configuration name, or {}


def decode_and_check(
    model, drafter, prompts: list[tuple[dict, list[int]]], ev: EvaluateConfig, stop_ids: set[int],
    worker: str = "", lossless: int | None = None,
) -> Responses:  # fmt: skip
    """The timed responses per method in the run dtype, the float32 ones of target-only, DFlash
    and DDTree per budget, the engine used and the prompt-lookup sweep's replays on the
    target-only outputs (Responses). `lossless`: how many of the first prompts the float32 pass
    decodes (None: ev.lossless_count of them)."""
    n = ev.max_new_tokens
    max_len = engine_length(prompts, ev, drafter.config.block_size)

    def decoders(methods: list[str], compile: bool | None = None) -> Decoders:
        return Decoders(
            model, drafter, methods, ev.engine, max_len, ev.tree_nodes, ev.tree_top_k, configured_lookup(ev),
            compile, ev.selector is not False,
        )  # fmt: skip

    timed, swept = decoders(ev.methods), {}
    try:
        main = timed.decode_all(prompts, n, stop_ids, f"evaluate{worker}")
        if "prompt_lookup" in main and ev.prompt_lookup_sweep:  # the baseline at its best
            t0 = time.perf_counter()
            outputs = [r.output_ids for r in main["target"]]
            swept = sweep([ids for _, ids in prompts], outputs, n, stop_ids)
            log.info("prompt lookup%s: %d configurations replayed on the target's outputs in "
                     "%.1f s", worker, len(swept), time.perf_counter() - t0)  # fmt: skip
            main["prompt_lookup_best"] = timed.lookup_all(
                prompts, best_lookups(prompts, swept), n, stop_ids, f"prompt lookup, best{worker}"
            )
    finally:
        timed.close()
    if not ev.lossless_check:
        return Responses(main, {}, timed.info(), swept)
    checked = [m for m in main if m == "target" or m == "dflash" or m.startswith("ddtree@")]
    if model.dtype == torch.float32:  # the timed responses are float32: every one is checked
        return Responses(main, {m: main[m] for m in checked}, timed.info(), swept)
    checked_prompts = prompts[: ev.lossless_count(len(prompts)) if lossless is None else lossless]
    if not checked_prompts:  # a worker's slice holds none of the first lossless_prompts
        return Responses(main, {m: [] for m in checked}, timed.info(), swept)
    # bf16 rounds a block forward and one-token forwards differently, so near-tied argmaxes
    # flip: losslessness is a float32 property, checked in float32 (a new engine: its buffers
    # and RoPE tables take the model's dtype; the bf16 one is dropped first). Its speed is not
    # reported, but its steps are compiled as the timed ones are (on CUDA): with graphs alone
    # the pass took 5 of a 9-minute run on an H200 (128 prompts, 5 methods).
    info, timed = timed.info(), None
    model.float()
    drafter.float()
    fp32 = decoders([m for m in ev.methods if m != "prompt_lookup"])
    try:
        return Responses(
            main, fp32.decode_all(checked_prompts, n, stop_ids, f"float32{worker}"), info, swept
        )
    finally:
        fp32.close()


# per level and method: the responses, the wall time, and the engine's counts of that decode
# (steps, prefills, prefill_s, host_s: ConcurrentEngine.decode)
ConcurrencyRuns = dict[int, dict[str, tuple[list[Decoded], float, dict]]]


def decode_concurrent(
    model, drafter, prompts: list[tuple[dict, list[int]]], ev: EvaluateConfig, stop_ids: set[int]
) -> ConcurrencyRuns:
    """evaluate.concurrency's pass: where a level is above 1, every prompt decoded c at a time
    (in as many whole passes as evaluate.concurrency_waves x c holds, at least one: a steady
    state, not only a ramp and a tail) for each level and for c = 1 (the curve's start,
    measured the same way, each prompt once), target-only, DFlash and prompt lookup (each
    source's best setting: `lookups_at_best`) on one static engine's models. Refused before any
    decoding where the target has no static engine or the largest level's buffers do not fit
    (naming the key). {} when every level is 1."""
    levels = sorted({1, *ev.concurrency})
    if levels == [1]:
        return {}
    try:
        check_target(model)
    except ValueError as e:
        raise ConfigError(
            f"evaluate.concurrency {ev.concurrency} needs the static engine: {e}"
        ) from e
    n = ev.max_new_tokens
    max_len = engine_length(prompts, ev, drafter.config.block_size)
    engine = Engine(model, max_len, drafter)
    try:
        check_rows(engine, levels[-1])
    except ValueError as e:
        raise ConfigError(str(e)) from e
    methods = ["target", "dflash"] + (["prompt_lookup"] if "prompt_lookup" in ev.methods else [])
    ids, lookups = [p for _, p in prompts], None
    runs: ConcurrencyRuns = {}
    for c in levels:
        rows = ConcurrentEngine(engine, c, refill=ev.concurrency_refill)
        # as many whole passes of the prompts as concurrency_waves x c holds (one row: no ramp)
        passes = 1 if c == 1 else max(1, ev.concurrency_waves * c // len(ids))
        for m in methods[:2]:  # compiled and captured before any timing
            rows.prepare(m)
        runs[c] = {}
        for m in methods:
            if m == "prompt_lookup":
                if lookups is None:  # from target-only's answers at c = 1 (one pass), the first
                    lookups = lookups_at_best(prompts, runs[c]["target"][0], ev, stop_ids)
                rows.prepare(m, lookups)
            out, wall = rows.decode(m, ids * passes, n, stop_ids, lookups and lookups * passes)
            counts = {k: getattr(rows, k) for k in ("steps_run", "prefills", "prefill_s", "host_s")}
            counts["passes"], counts["refill"] = passes, rows.refill
            if m == "prompt_lookup":  # the setting each source's rows used
                settings = zip(prompts, lookups, strict=True)
                counts["settings"] = {row["source"]: cfg.name for (row, _), cfg in settings}
            runs[c][m] = out, wall, counts
        log.info("concurrency %d: %s", c, ", ".join(
            f"{m} {sum(len(d.output_ids) for d in out) / wall:.1f} tok/s ({k['steps_run']} steps,"
            f" {k['prefills']} refill packs {_refill_note(k, wall)}, host "
            f"{1e3 * k['host_s'] / max(k['steps_run'], 1):.2f} ms/step)"
            for m, (out, wall, k) in runs[c].items()))  # fmt: skip
        del rows
        if model.device.type == "cuda":
            torch.cuda.empty_cache()
    return runs


def _refill_note(counts: dict, wall: float) -> str:
    """Where a level's refill packs ran, for its log line."""
    if counts["refill"] == "step":
        return f"in its steps, {wall:.1f} s"
    return f"= {counts['prefill_s'] / wall:.0%} of {wall:.1f} s"


def lookups_at_best(
    prompts: list[tuple[dict, list[int]]], target: list[Decoded], ev: EvaluateConfig,
    stop_ids: set[int],
) -> list[LookupConfig]:  # fmt: skip
    """Prompt lookup's setting per prompt under load: its source's best in the sweep replayed on
    target-only's answers, as the per-prompt pass's baseline at its best (the configured one
    where evaluate.prompt_lookup_sweep is off)."""
    if not ev.prompt_lookup_sweep:
        return [configured_lookup(ev)] * len(prompts)
    outputs = [d.output_ids for d in target]
    swept = sweep([p for _, p in prompts], outputs, ev.max_new_tokens, stop_ids)
    return best_lookups(prompts, swept)


def concurrency_figures(runs: ConcurrencyRuns, one_at_a_time: dict[str, list[Decoded]]) -> dict:
    """metrics.json's `concurrency`: per level and method generated tok/s (every token over the
    wall time, prefills included), speedup against target-only at that level, tau, and the
    share of responses equal to the per-prompt pass's in the run dtype (1.0 in float32; bf16
    may flip near-ties where the batch changes the rounding); the lowest level where DFlash is
    slower than target-only (None: not reached up to the largest). Where the wall time went:
    refills (`prefills` packs; `prefill_share` where they run apart, `refill` "pack"; 0 where
    they ride in the steps), host work between steps while the device idles
    (`host_ms_per_step`), and the rest per step (`step_ms`: the step's device work, its launch
    and read-back); `step_cost` is step_ms over target-only's at that level. Prompt lookup's
    `settings`: the one each source's prompts used."""
    levels: dict[str, dict] = {}
    for c, by_method in sorted(runs.items()):
        rates, step_ms, host_ms = {}, {}, {}
        for m, (out, wall, k) in by_method.items():
            rates[m] = sum(len(d.output_ids) for d in out) / wall
            steps = max(k["steps_run"], 1)
            step_ms[m] = 1e3 * (wall - k["prefill_s"] - k["host_s"]) / steps
            host_ms[m] = 1e3 * k["host_s"] / steps
        levels[str(c)] = {
            m: {
                "tokens_per_s": rates[m],
                "speedup": rates[m] / rates["target"],
                "acceptance_length": _mean([t for d in out if (t := d.acceptance_length) is not None]),
                "wall_s": wall,
                "steps": k["steps_run"],
                "step_ms": step_ms[m],
                "step_cost": step_ms[m] / step_ms["target"],
                "host_ms_per_step": host_ms[m],
                "prefills": k["prefills"],
                "prefill_share": k["prefill_s"] / wall,
                "refill": k["refill"],
                **({"settings": k["settings"]} if "settings" in k else {}),
                "passes": k["passes"],
                "same_as_one_at_a_time": _mean([
                    float(d.output_ids == ref.output_ids)
                    for d, ref in zip(out, one_at_a_time.get(m, []) * k["passes"], strict=False)
                ]),
            }
            for m, (out, wall, k) in by_method.items()
        }  # fmt: skip
    below = [int(c) for c, row in levels.items() if row["dflash"]["speedup"] < 1.0]
    return {"levels": levels, "dflash_below_target_at": min(below) if below else None,
            "largest": max(runs)}  # fmt: skip


def best_lookups(
    prompts: list[tuple[dict, list[int]]], swept: dict[str, list[Decoded]]
) -> list[LookupConfig]:
    """Per prompt, the prompt-lookup configuration of lookup.GRID with the highest tau on its
    source in the sweep's replays."""
    names = best_per_source(prompts, swept)
    grid = {c.name: c for c in GRID}
    return [grid[names[row["source"]]] for row, _ in prompts]


def _decode_slice(target_cfg: TargetConfig, drafter_dir: str, device: str, prompts: list,
                  ev: EvaluateConfig, stop_ids: set[int], worker: str, threads: int,
                  lossless: int) -> Responses:  # fmt: skip
    """One worker process: its own copy of the models, one slice of the prompts, `threads` its
    share of the cores, the first `lossless` of its prompts checked in float32."""
    torch.set_num_threads(threads)
    model, _, drafter = load_models(target_cfg, drafter_dir, torch.device(device))
    return decode_and_check(model, drafter, prompts, ev, stop_ids, worker, lossless)


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
    # Every process keeps to its share of the cores (this one too): a thread more makes OpenMP
    # spin against its neighbours. On a CPU, one sequence decodes about as fast on one thread as
    # on two (benchmarks/RESULTS.md, "evaluate on 2 CPU cores"), so two processes of one thread
    # decode twice the prompts; on a GPU each process needs one thread to launch kernels.
    threads = 1
    if model.device.type == "cpu":
        threads = max(1, torch.get_num_threads() // workers)
        torch.set_num_threads(threads)
    checked = ev.lossless_count(len(prompts))
    # slice k checks its prompts among the first `checked`: k, k + workers, ...
    lossless = [len(range(k, checked, workers)) for k in range(workers)]
    with ProcessPoolExecutor(workers - 1, mp_context=get_context("spawn")) as pool:
        args = (target_cfg, str(drafter_dir), str(model.device))
        futures = [
            pool.submit(
                _decode_slice, *args, part, ev, stop_ids, f" [{k}/{workers}]", threads, lossless[k]
            )
            for k, part in enumerate(slices[1:], start=1)
        ]
        parts = [
            decode_and_check(
                model, drafter, slices[0], ev, stop_ids, f" [0/{workers}]", lossless[0]
            )
        ]
        parts += [f.result() for f in futures]

    def merged(lists: list[list[Decoded]]) -> list[Decoded]:
        """The slices' responses back in prompt order (the lossless ones: the first `checked`)."""
        out: list[Decoded] = [None] * sum(map(len, lists))  # type: ignore[list-item]
        for k, part in enumerate(lists):
            for j, d in enumerate(part):
                out[k + j * workers] = d
        return out

    first = parts[0]
    return Responses(
        timed={m: merged([p.timed[m] for p in parts]) for m in first.timed},
        lossless={m: merged([p.lossless[m] for p in parts]) for m in first.lossless},
        engine=first.engine,  # each process runs the same engine kind
        swept={c: merged([p.swept[c] for p in parts]) for c in first.swept},
    )


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


@dataclass(frozen=True)
class EvaluateSettings:
    """What evaluate reads of a config: a whole Config has both sections; outside the workflow
    the CLI makes one of --target and the evaluate defaults."""

    target: TargetConfig
    evaluate: EvaluateConfig


@dataclass(frozen=True)
class EvaluatePaths:
    """What one evaluate job reads and writes: the drafter export, the eval prompts, metrics."""

    drafter: Path
    prompts: Path
    out: Path


def run(cfg: Config | EvaluateSettings, paths: EvaluatePaths, lease: DeviceLease = ANY_DEVICE
        ) -> dict:  # fmt: skip
    """Evaluate the drafter export against the target on the leased device; write and return
    the metrics."""
    with lease.hold() as device:
        metrics = measure(cfg.target, cfg.evaluate, paths, device)
    ev = cfg.evaluate
    if not ev.lossless_check:
        log.warning("evaluate.lossless_check is off: the outputs were not checked in float32")
    elif metrics["lossless_fraction"] < 1.0:
        log.error("speculative output differs from greedy: %s", metrics["first_divergence"])
    for n, tree in metrics["ddtree"].items():
        if tree.get("lossless_fraction", 1.0) < 1.0:
            log.error("ddtree@%s output differs from greedy: %s", n, tree["first_divergence"])
    write_json(paths.out, metrics)
    for m, row in [*metrics["methods"].items(), *metrics["ddtree"].items()]:
        log.info("%s: tau %s, %.1f decode tokens/s, speedup %s (vs %s, %s engine)", m,
                 row["acceptance_length"], row["decode_tokens_per_s"], row["speedup"],
                 row["speedup_against"], row["engine"])  # fmt: skip
    log.info("lossless %s -> %s", metrics["lossless_fraction"], paths.out)
    return metrics


def measure(target_cfg: TargetConfig, ev: EvaluateConfig, paths: EvaluatePaths,
            device: torch.device) -> dict:  # fmt: skip
    """Every method's figures on the eval prompts (metrics.json's content)."""
    from dflashpipe.target import attention_choice

    rows = read_eval_prompts(paths.prompts, ev.num_prompts)
    model, tok, drafter = load_models(target_cfg, paths.drafter, device)
    run_dtype, cfg = model.dtype, drafter.config
    context = min(
        model.config.get_text_config().max_position_embeddings, cfg.max_position_embeddings
    )
    largest = max(ev.tree_nodes)
    if "ddtree" in ev.methods and 1 + ev.max_new_tokens + largest + 1 > context:
        raise ConfigError(
            f"evaluate.tree_nodes {largest} + its root + max_new_tokens {ev.max_new_tokens} + "
            f"a one-token prompt exceed the context of {context} positions "
            "(max_position_embeddings of the target and drafter)"
        )
    skipped: Counter = Counter(prompt_too_long=0, template_error=0)
    prompts = encode_rows(rows, tok, ev, context, slack(ev, cfg.block_size), skipped)
    if not prompts:
        raise DataError(
            f"none of the {len(rows)} eval prompts of {paths.prompts} can be decoded "
            f"(skipped: {dict(skipped)}); the context is {context} tokens"
        )
    log.info("%d prompts on %s in %s, %d worker process(es) (skipped %s)", len(prompts), device,
             run_dtype, min(ev.workers, len(prompts)), dict(skipped))  # fmt: skip
    stop_ids = end_of_turn_ids(tok)
    concurrent = decode_concurrent(model, drafter, prompts, ev, stop_ids)
    responses = decode_in_workers(model, drafter, prompts, ev, stop_ids, target_cfg, paths.drafter)
    metrics = summarize(
        prompts,
        responses.timed,
        responses.lossless,
        cfg.block_size,
        configured_lookup(ev),
        reduced_precision=run_dtype != torch.float32,
        engine=responses.engine,
        lookup_sweep=responses.swept or None,
    )
    metrics |= {"num_prompts": len(prompts), "skipped": dict(skipped), "settings": asdict(ev)}
    if concurrent:
        metrics["concurrency"] = concurrency_figures(concurrent, responses.timed)
    metrics |= run_info(target_cfg, paths.drafter, cfg, device, run_dtype)
    return metrics | {
        "attn_implementation": attention_choice(target_cfg),
        "prompt_format": prompt_format(tok),
    }
