"""Stage 7, report: plots and a Markdown summary of one workflow run.

    train/metrics.jsonl ─► loss.png (loss and per-slot accuracy vs step)
                         ─► acceptance.png (expected tau from slot accuracies vs measured tau)
    eval/metrics.json   ─► histogram.png (accepted length per verify step), throughput table
                          (a row per method and per DDTree budget)
                        ─► ddtree.png (tau and speedup vs tree budget; when DDTree ran)
                        ─► concurrency.png and a table (speedup and tok/s vs concurrency per
                          method; when evaluate.concurrency measured a level above 1)
    prompts/stats.json, features/manifest.json ─► data section of report.md (each drop reason
                                                 explained from sources.DROP_REASONS)
    eval/metrics.json's drafter and target     ─► SGLang and vLLM launch lines for this drafter

The rule marks the outputs with Snakemake's `report()`, so `snakemake --report report.html`
gathers them into one page.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from dflashpipe.decoding.lookup import GRID, OCCURRENCES, SEARCHES
from dflashpipe.errors import DataError
from dflashpipe.plots import (
    plot_acceptance,
    plot_concurrency,
    plot_ddtree,
    plot_histogram,
    plot_loss,
)
from dflashpipe.serving import serving
from dflashpipe.sources import DROP_REASONS
from dflashpipe.storage import atomic_path


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise DataError(f"report input not found: {path}")
    return json.loads(path.read_text())


def read_training(path: Path) -> list[dict]:
    if not path.is_file():
        raise DataError(f"report input not found: {path}")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows:
        raise DataError(f"{path} holds no training metrics")
    return rows


def _refills(row: dict) -> str:
    """A level's refills for the table: their share of the time where they run apart, else
    how many steps carried a pack (evaluate.concurrency_refill)."""
    if row.get("refill", "pack") == "pack":
        return f"{row['prefill_share']:.0%} of its time"
    return f"{row['prefills']} packs, in steps"


def under_load(evaluation: dict, img: str) -> str:
    """The concurrency table and where DFlash stops paying; '' without levels above 1."""
    figures = evaluation.get("concurrency")
    if not figures:
        return ""
    levels = figures["levels"]
    lookup = "prompt_lookup" in levels["1"]
    head = ("| concurrency | target tok/s | DFlash tok/s | DFlash speedup | DFlash tau | "
            "DFlash step (target steps) | DFlash refills |")  # fmt: skip
    head += " prompt lookup speedup (best setting per source) |" if lookup else ""
    lines = [head, "|---" * (7 + lookup) + "|"]
    for c in sorted(levels, key=int):
        t, d = levels[c]["target"], levels[c]["dflash"]
        row = (f"| {c} | {t['tokens_per_s']:.1f} | {d['tokens_per_s']:.1f} | {d['speedup']:.2f}x | "
               f"{_fmt(d['acceptance_length'])} | {d['step_cost']:.2f} | "
               f"{_refills(d)} |")  # fmt: skip
        lines.append(row + (f" {levels[c]['prompt_lookup']['speedup']:.2f}x |" if lookup else ""))
    below = figures["dflash_below_target_at"]
    verdict = (f"DFlash is slower than target-only from concurrency {below}" if below
               else f"DFlash pays at every level measured, up to concurrency {figures['largest']}")  # fmt: skip
    table = "\n".join(lines)
    return f"""## Under load (evaluate.concurrency)
The prompts decoded c at a time with continuous refill; tok/s counts every generated token over
the wall time, prefills included. A DFlash step's cost is its time (without host work, and
without refills where they run apart) in target-only steps of the same level. {verdict}.

{table}

![concurrency]({img}/concurrency.png)
"""


def _fmt(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _held_out(rows: list[dict]) -> str:
    held = [r for r in rows if "val_expected_acceptance" in r]
    if not held:
        return ""
    r = held[-1]
    chain = r.get("val_selector_chain_acceptance", r.get("val_chain_acceptance"))
    along = f" ({chain:.3f} along its drafted chains)" if chain is not None else ""
    return (f"; on held-out samples (step {r['step']}): loss {r['val_loss']:.4f}, expected "
            f"acceptance length {r['val_expected_acceptance']:.3f}{along}")  # fmt: skip


def _data(row: dict) -> str:
    """' on N samples (T tokens an epoch)' from a metrics row (rows before train counted: '')."""
    if "train_tokens" not in row:
        return ""
    return f" on {row['train_samples']:,} samples ({row['train_tokens']:,} tokens an epoch)"


# The SmolLM2 GPU recipe's drafter trained on 11.0 M tokens an epoch for tau 2.9-3.5 (docs/quality.md);
# the embedded default's on about 18K, for tau about 1: below this, the report says so.
USEFUL_TOKENS = 1_000_000


def _demonstration(row: dict) -> str:
    """A sentence under the training line when the drafter trained on fewer than USEFUL_TOKENS
    tokens an epoch (a demonstration of the pipeline, not a useful drafter); '' otherwise, and
    for metrics written before train counted its tokens."""
    tokens = row.get("train_tokens")
    if tokens is None or tokens >= USEFUL_TOKENS:
        return ""
    return (f"\n\nThis drafter trained on {tokens:,} tokens an epoch, a demonstration of the "
            "pipeline and not a useful drafter (tau near 1, below prompt lookup): a useful one "
            "takes millions, as the SmolLM2 GPU recipe `configs/smollm2-sharegpt.yaml` trains on "
            "11 M for tau 2.9-3.5 (`snakemake --cores all --configfile "
            "configs/smollm2-sharegpt.yaml` on a GPU; docs/quality.md).")  # fmt: skip


def _ahead(counts: dict | None) -> str:
    """'k of n' prompts where the drafter's tau is above prompt lookup's (metrics before the
    paired count existed: '-')."""
    return f"{counts['ahead']} of {sum(counts.values())}" if counts else "-"


def _config(name: str | None, before: str = "") -> str:
    """A prompt-lookup configuration's name in backticks ('-' for metrics without one); the
    configured one, which lookup_baseline keys as 'NAME (timed)', is called that."""
    if not name:
        return "" if before else "-"
    configured = " (the configured one)" if name.endswith(" (timed)") else ""
    return f"{before}`{name.removesuffix(' (timed)')}`{configured}"


def _speed(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _lossless(evaluation: dict) -> str:
    x, checked = evaluation["lossless_fraction"], evaluation.get("lossless_prompts")
    if x is None:
        return "not checked (evaluate.lossless_check: false)"
    of = f" of {checked} prompts" if checked and checked < evaluation["num_prompts"] else ""
    return f"**{x:.3f}**{of}"


# Prompt lookup "at its best" means one thing throughout the report: each prompt under its
# source's best configuration of the sweep (the Evaluation table, the decoded
# `prompt_lookup_best` row, the speedup). The one configuration best over all prompts
# (metrics' `baseline.prompt_lookup.acceptance_length`, never above it) and the configured one
# (the methods table's first lookup row) are named apart: the summary once called the first
# "at its best" beside a table row of the configured one's, two taus a reader could not square.
BEST = "at its best (each source's best configuration)"


def _lookup_best_tau(evaluation: dict) -> float | None:
    """Prompt lookup at its best over all prompts: the mean of the prompts' taus, each under
    its source's best configuration (summarize writes it per response), so the per-source
    table's figures pooled; None for metrics without it."""
    taus = [t for r in evaluation.get("responses", [])
            if (t := r.get("prompt_lookup_acceptance_length")) is not None]  # fmt: skip
    return sum(taus) / len(taus) if taus else None


def lookup_names() -> str:
    """How a prompt-lookup configuration's name reads (decoding/lookup.py), said once."""
    ns = sorted({c.max_ngram_size for c in GRID})
    ks = ", ".join(str(k) for k in sorted({c.num_drafts for c in GRID}))
    return (f"A prompt-lookup configuration is named `occurrence n<=N k=K search`: each step "
            f"drafts the K tokens that followed an earlier occurrence of the text's last n tokens, "
            f"n tried from N down to 1, the {' or '.join(OCCURRENCES)} occurrence, looked for in "
            f"{' or '.join(f'`{x}`' for x in SEARCHES)} (all the text so far, or the prompt "
            "alone); `earliest n<=2 k=10 all` is transformers' `prompt_lookup_num_tokens=10`. "
            f"evaluate replays {len(GRID)} of them (N {ns[0]}-{ns[-1]}, K {ks}) on the "
            "target-only outputs, exact since decoding is greedy, and keeps per source the one "
            "of the highest tau: prompt lookup at its best.")  # fmt: skip


def _lookup_taus(evaluation: dict, lookup: dict) -> str:
    """Prompt lookup's taus for the summary line, each named: at its best, the one
    configuration best over all prompts, as configured (what older metrics lack: left out)."""
    figures = []
    if (best := _lookup_best_tau(evaluation)) is not None:
        figures.append(
            f"**{best:.3f}** {BEST.removesuffix(')')}: the table's, over all its prompts)"
        )
    overall = _fmt(lookup.get("acceptance_length"))
    if lookup.get("best"):
        figures.append(f"{overall} for the one configuration best over all prompts "
                       f"({_config(lookup['best'])})")  # fmt: skip
    elif best is None:
        figures.append(f"{overall} at its best")
    if (configured := lookup.get("configured_acceptance_length")) is not None:
        figures.append(f"{configured:.3f} as configured ({_config(lookup.get('configured'))})")
    return "; prompt lookup's: " + "; ".join(figures)


def _lookup_speeds(evaluation: dict, lookup: dict) -> str:
    """Prompt lookup's speedups, each named: at its best (decoded as `prompt_lookup_best`) and
    as configured (metrics from before the configured speedup was kept: one figure)."""
    if "configured_speedup" not in lookup:
        return f"; prompt lookup{_config(lookup.get('configured'), ' ')}: {_speed(lookup.get('speedup'))}"
    configured = (f"{_speed(lookup['configured_speedup'])} as configured "
                  f"({_config(lookup.get('configured'))})")  # fmt: skip
    methods = evaluation.get("methods")
    if methods is not None and "prompt_lookup_best" not in methods:  # sweep off: none decoded
        return f"; prompt lookup's: {configured}"
    return f"; prompt lookup's: **{_speed(lookup.get('speedup'))}** {BEST}; {configured}"


def methods_table(evaluation: dict) -> str:
    """One row per method and per DDTree budget (metrics from before `methods` existed: decode
    tokens/s of the three methods)."""
    tps, lookup = evaluation["tokens_per_s"], evaluation["baseline"].get("prompt_lookup")
    if "methods" not in evaluation:
        rows = [("target only", tps["target_only"]), ("DFlash drafter", tps["speculative"])]
        rows += [("prompt lookup", lookup["tokens_per_s"])] if lookup else []
        return "| method | decode tokens/s |\n|---|---|\n" + "\n".join(
            f"| {name} | {speed:.1f} |" for name, speed in rows
        )
    configured = _config(lookup.get("configured"), " ") if lookup else ""
    names = {"target": "target only", "dflash": "DFlash drafter",
             "prompt_lookup": f"prompt lookup as configured{configured}",
             "prompt_lookup_best": f"prompt lookup {BEST}"}  # fmt: skip
    rows = [(names.get(m, m), r) for m, r in evaluation["methods"].items()]
    rows += [(f"DDTree, {n} nodes", r) for n, r in evaluation.get("ddtree", {}).items()]
    lines = [
        f"| {name} | {r['engine']} | {_fmt(r['acceptance_length'])} | "
        f"{_fmt(r.get('tokens_per_step'))} | {_fmt(r.get('step_cost'), 2)} | "
        f"{r['decode_tokens_per_s']:.1f} | {_speed(r['speedup'])} vs {r['speedup_against']} | "
        f"{_fmt(r.get('lossless_fraction'))} |"
        for name, r in rows
    ]
    head = ("| method | engine | tau | tokens per step | step (target steps) | decode tokens/s | "
            "speedup | lossless (float32) |\n")  # fmt: skip
    note = ("\n\ntau is the mean of the prompts' acceptance lengths; tokens per step pools every "
            "step of every prompt, and step is a method's mean step in target-only steps, so "
            "speedup = tokens per step / step.")  # fmt: skip
    return (head + "|---|---|---|---|---|---|---|---|\n" + "\n".join(lines) + _eager(evaluation)
            + note + _worker_choice(evaluation))  # fmt: skip


def _worker_choice(evaluation: dict) -> str:
    """Why the decoded best-lookup row can differ from the summary's figure: with several
    evaluate workers each picks its sources' best on its own share of the prompts."""
    workers = min((evaluation.get("settings") or {}).get("workers", 1), evaluation["num_prompts"])
    if workers < 2 or "prompt_lookup_best" not in evaluation["methods"]:
        return ""
    return (f" With evaluate.workers {workers}, each worker process picks its sources' best "
            "configurations on its own share of the prompts for the decoded row at its best, so "
            "its tau can differ from the summary's, whose configurations are chosen over all "
            "prompts.")  # fmt: skip


def _eager(evaluation: dict) -> str:
    """Below the table, why the methods ran on the eager loop (its speedups are those of a
    Python loop over the HF model, and DDTree has no eager loop), when they did."""
    engine = evaluation.get("engine") or {}
    if engine.get("kind") != "eager":
        return ""
    return (f"\n\neager loop: {engine.get('reason') or 'evaluate.engine: eager'} (speedups of the "
            "eager loop, not the static engine's; DDTree needs the static engine: not run)")  # fmt: skip


def _features(manifest: dict) -> str:
    totals = manifest["totals"]
    group = manifest.get("group_size")  # fp4-zstd's; older manifests lack the key
    codec = manifest["codec"] + (f", groups of {group}" if group else "")
    return (f"{totals['samples']} samples, {totals['tokens']} tokens, {totals['bytes'] / 1e6:.1f} "
            f"MB ({codec})")  # fmt: skip


def _engine(evaluation: dict) -> str:
    engine = evaluation.get("engine")
    if not engine:
        return ""
    graphs = ", CUDA graphs" if engine["graphs"] else ""
    graphs += ", compiled steps" if engine.get("compiled") else ""
    eager = " (why: below the methods table)" if engine["kind"] == "eager" else ""
    return f"\n- engine: {engine['kind']}{graphs}{eager}"


def _dropped(prompts: dict) -> str:
    """The prompts stage's drops, a line per reason with what one count of it is
    (sources.DROP_REASONS) and, where several sources dropped for it, each one's share."""
    totals = prompts["totals"]["dropped"]
    if not totals:
        return "nothing dropped"
    lines = []
    for reason, n in sorted(totals.items(), key=lambda item: (-item[1], item[0])):
        shares = [f"{name} {stats['dropped'][reason]:,}"
                  for name, stats in prompts.get("sources", {}).items()
                  if stats.get("dropped", {}).get(reason)]  # fmt: skip
        split = f" ({', '.join(shares)})" if len(shares) > 1 else ""
        meaning = DROP_REASONS.get(reason, "a reason sources.DROP_REASONS no longer lists")
        lines.append(f"\n  - `{reason}` {n:,}{split}: {meaning}")
    return "left out by the prompts stage, a count per reason:" + "".join(lines)


def _decoded(evaluation: dict) -> str:
    """Which of the held-out prompts evaluate decoded: the first evaluate.num_prompts, round
    robin over the sources, less those it skipped (metrics before `settings`: the count)."""
    asked = (evaluation.get("settings") or {}).get("num_prompts")
    if asked is None:
        return f"evaluate decoded {evaluation['num_prompts']} of them"
    skipped = sum((evaluation.get("skipped") or {}).values())
    skips = (f", less {skipped} too long for the context or refused by the chat template"
             if skipped else "")  # fmt: skip
    return (f"evaluate decoded {evaluation['num_prompts']} of them: the first "
            f"evaluate.num_prompts ({asked}), taken round robin over the sources{skips}")  # fmt: skip


def _per_source(evaluation: dict, lookup: dict) -> str:
    """The Evaluation table: per eval source its decoded prompts, DFlash's tau, prompt lookup's
    at its best and its configuration, and the paired count."""
    lookup_tau, ahead = lookup.get("per_source", {}), lookup.get("dflash_ahead", {})
    chosen = lookup.get("best_per_source", {})
    counts = Counter(r["source"] for r in evaluation.get("responses", []))
    rows = "\n".join(
        f"| {s} | {counts.get(s, '-')} | {t:.3f} | {_fmt(lookup_tau.get(s))} | "
        f"{_config(chosen.get(s))} | {_ahead(ahead.get(s))} |"
        for s, t in sorted(evaluation["per_source"].items())
    )
    head = (f"| source | prompts | DFlash tau | prompt lookup tau {BEST} | its configuration | "
            "prompts where the drafter is ahead |\n|---|---|---|---|---|---|\n")  # fmt: skip
    return head + rows + (f"\n\n{lookup_names()}" if lookup else "")


def summary(rows: list[dict], evaluation: dict, prompts: dict, manifest: dict, img: str,
            extra: dict[str, dict] | None = None) -> str:  # fmt: skip
    """The Markdown summary; `img` is the plot folder relative to the Markdown file, `extra` the
    manifests of train.extra_features by path."""
    lookup = evaluation["baseline"].get("prompt_lookup", {})
    held_out = prompts["totals"]["eval"]
    added = "".join(
        f"\n- train.extra_features {p}: {_features(m)}" for p, m in (extra or {}).items()
    )
    return f"""# dflashpipe report

## Data
- prompts: {prompts["totals"]["train"]:,} train, {held_out:,} held out for evaluation ({_decoded(evaluation)}); {_dropped(prompts)}
- features: {_features(manifest)}, layers {manifest["layer_ids"]} of {manifest["target"]["name"]}{added}

## Training
- {rows[-1]["step"]} optimizer steps{_data(rows[-1])}; final loss {rows[-1]["loss"]:.4f}; expected acceptance length {rows[-1]["expected_acceptance"]:.3f}{_held_out(rows)}{_demonstration(rows[-1])}

![loss]({img}/loss.png)
![acceptance]({img}/acceptance.png)

## Evaluation ({evaluation["num_prompts"]} of the {held_out:,} held-out prompts, {evaluation.get("run_dtype", "")}, {evaluation.get("device", "")})
{_per_source(evaluation, lookup)}

- acceptance length tau (the mean of the prompts' taus): **{evaluation["acceptance_length"]:.3f}**{_lookup_taus(evaluation, lookup) if lookup else ""}
- lossless fraction (float32): {_lossless(evaluation)}
- speedup vs target-only greedy: **{evaluation["speedup"]:.2f}x**{_lookup_speeds(evaluation, lookup) if lookup else ""}{_engine(evaluation)}

{methods_table(evaluation)}

![histogram]({img}/histogram.png)
{f"![ddtree]({img}/ddtree.png)" if evaluation.get("ddtree") else ""}

{under_load(evaluation, img)}
{serving(evaluation)}"""


@dataclass(frozen=True)
class ReportPaths:
    """What the report reads (the run's metrics, prompt stats and feature manifests: its own,
    then train.extra_features') and writes (a folder of plots, the Markdown summary)."""

    train_metrics: Path
    eval_metrics: Path
    prompt_stats: Path
    manifest: Path
    plots: Path
    out: Path
    extra_manifests: list[Path] = field(default_factory=list)


def run(paths: ReportPaths) -> None:
    """Write loss.png, acceptance.png, histogram.png (and ddtree.png, concurrency.png) into
    `paths.plots` and the summary to `paths.out`. The report reads no config key: its shape is
    run(paths), without the cfg of the other stages."""
    out, md = Path(paths.plots), Path(paths.out)
    rows = read_training(Path(paths.train_metrics))
    evaluation = _read_json(Path(paths.eval_metrics))
    plot_loss(rows, out / "loss.png")
    plot_acceptance(rows, evaluation, _lookup_best_tau(evaluation), out / "acceptance.png")
    plot_histogram(evaluation, out / "histogram.png")
    if evaluation.get("ddtree"):
        plot_ddtree(evaluation, out / "ddtree.png")
    if evaluation.get("concurrency"):
        plot_concurrency(evaluation, out / "concurrency.png")
    img = os.path.relpath(out, md.parent)
    extra = {p: _read_json(Path(p)) for p in paths.extra_manifests}
    prompts, manifest = _read_json(Path(paths.prompt_stats)), _read_json(Path(paths.manifest))
    text = summary(rows, evaluation, prompts, manifest, img, extra)
    with atomic_path(md) as tmp:
        tmp.write_text(text, encoding="utf-8")
