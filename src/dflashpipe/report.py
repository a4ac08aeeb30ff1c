"""Stage 7, report: plots and a Markdown summary of one workflow run.

    train/metrics.jsonl ─► loss.png (loss and per-slot accuracy vs step)
                         ─► acceptance.png (expected tau from slot accuracies vs measured tau)
    eval/metrics.json   ─► histogram.png (accepted length per verify step), throughput table
                          (a row per method and per DDTree budget)
                        ─► ddtree.png (tau and speedup vs tree budget; when DDTree ran)
                        ─► concurrency.png and a table (speedup and tok/s vs concurrency per
                          method; when evaluate.concurrency measured a level above 1)
    prompts/stats.json, features/manifest.json ─► data section of report.md
    eval/metrics.json's drafter and target     ─► SGLang and vLLM launch lines for this drafter

The rule marks the outputs with Snakemake's `report()`, so `snakemake --report report.html`
gathers them into one page.
"""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; no display on cluster nodes
import matplotlib.pyplot as plt  # noqa: E402

from dflashpipe.errors import DataError  # noqa: E402
from dflashpipe.storage import atomic_path  # noqa: E402


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


def _save(fig, dest: Path) -> None:
    with atomic_path(dest) as tmp:
        fig.savefig(tmp, format="png", dpi=120, bbox_inches="tight")
    plt.close(fig)


def plot_loss(rows: list[dict], dest: Path) -> None:
    steps = [r["step"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.plot(steps, [r["loss"] for r in rows])
    ax1.set(xlabel="optimizer step", ylabel="weighted CE loss", title="training loss")
    slots = len(rows[0]["slot_accuracy"])
    for k in range(slots):
        ax2.plot(steps, [r["slot_accuracy"][k] for r in rows], label=f"slot {k + 1}",
                 color=plt.cm.viridis(k / max(1, slots - 1)))  # fmt: skip
    ax2.set(xlabel="optimizer step", ylabel="accuracy", title="per-slot accuracy", ylim=(0, 1))
    ax2.legend(fontsize=6, ncol=2)
    _save(fig, dest)


def plot_acceptance(rows: list[dict], evaluation: dict, dest: Path) -> None:
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["step"] for r in rows], [r["expected_acceptance"] for r in rows],
            label="expected, from training slot accuracies")  # fmt: skip
    held = [r for r in rows if "val_expected_acceptance" in r]
    if held:
        ax.plot([r["step"] for r in held], [r["val_expected_acceptance"] for r in held], "o-",
                label="expected, from held-out slot accuracies")  # fmt: skip
    ax.axhline(evaluation["acceptance_length"], color="C1", linestyle="--",
               label=f"measured tau {evaluation['acceptance_length']:.2f} (evaluate)")  # fmt: skip
    if lookup := evaluation["baseline"].get("prompt_lookup"):
        tau = lookup["acceptance_length"]
        ax.axhline(tau, color="C2", linestyle=":", label=f"prompt lookup tau {tau:.2f}")
    ax.set(xlabel="optimizer step", ylabel="acceptance length", title="acceptance length")
    ax.legend()
    _save(fig, dest)


def plot_histogram(evaluation: dict, dest: Path) -> None:
    hist = {int(k): v for k, v in evaluation["histogram"].items()}
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar(list(hist), list(hist.values()))
    ax.set(xlabel="tokens accepted per verify step (drafts + 1)", ylabel="verify steps",
           title=f"acceptance histogram (tau {evaluation['acceptance_length']:.2f})")  # fmt: skip
    _save(fig, dest)


def plot_ddtree(evaluation: dict, dest: Path) -> None:
    """tau and speedup per DDTree budget, DFlash's (one chain of block_size - 1) as reference."""
    budgets = sorted(evaluation["ddtree"], key=int)
    rows = [evaluation["ddtree"][b] for b in budgets]
    nodes = [int(b) for b in budgets]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, name in ((ax1, "acceptance_length", "tau"), (ax2, "speedup", "speedup")):
        ax.plot(nodes, [r[key] for r in rows], "o-", label="DDTree")
        if evaluation.get(key) is not None:
            ax.axhline(evaluation[key], color="C1", linestyle="--", label="DFlash chain")
        ax.set(xscale="log", xlabel="tree budget (nodes verified per step)", ylabel=name,
               title=f"DDTree {name} vs budget")  # fmt: skip
        ax.set_xticks(nodes, budgets)
        ax.minorticks_off()  # log-scale minor labels would overprint the budgets
        ax.legend()
    _save(fig, dest)


def plot_concurrency(evaluation: dict, dest: Path) -> None:
    """Speedup against target-only at the same concurrency, and generated tok/s, per method."""
    levels = evaluation["concurrency"]["levels"]
    cs = sorted(levels, key=int)
    xs = [int(c) for c in cs]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for m in levels[cs[0]]:
        ax1.plot(xs, [levels[c][m]["speedup"] for c in cs], "o-", label=m)
        ax2.plot(xs, [levels[c][m]["tokens_per_s"] for c in cs], "o-", label=m)
    ax1.axhline(1.0, color="grey", linestyle=":")
    ax1.set(ylabel="speedup vs target-only at the same concurrency", title="speedup under load")
    ax2.set(ylabel="generated tokens/s (all sequences)", title="throughput under load")
    for ax in (ax1, ax2):
        ax.set(xscale="log", xlabel="concurrency (sequences decoded at once)")
        ax.set_xticks(xs, cs)
        ax.minorticks_off()
        ax.legend()
    _save(fig, dest)


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
    return (f"; on held-out samples (step {r['step']}): loss {r['val_loss']:.4f}, expected "
            f"acceptance length {r['val_expected_acceptance']:.3f}")  # fmt: skip


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
    """A prompt-lookup configuration's name in backticks ('-' for metrics without one)."""
    return f"{before}`{name}`" if name else ("" if before else "-")


def _speed(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _lossless(evaluation: dict) -> str:
    x, checked = evaluation["lossless_fraction"], evaluation.get("lossless_prompts")
    if x is None:
        return "not checked (evaluate.lossless_check: false)"
    of = f" of {checked} prompts" if checked and checked < evaluation["num_prompts"] else ""
    return f"**{x:.3f}**{of}"


def _lookup_speeds(lookup: dict) -> str:
    """Prompt lookup's speedups: at its best (what metrics' `speedup` holds once the best was
    decoded) and as configured, each under its own name (metrics from before the configured
    speedup was kept: one figure)."""
    if "configured_speedup" not in lookup:
        return f"prompt lookup{_config(lookup.get('configured'), ' ')}: {_speed(lookup.get('speedup'))}"
    return (f"prompt lookup at its best: {_speed(lookup.get('speedup'))}; configured"
            f"{_config(lookup.get('configured'), ' ')}: {_speed(lookup['configured_speedup'])}")  # fmt: skip


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
    names = {"target": "target only", "dflash": "DFlash drafter", "prompt_lookup": "prompt lookup",
             "prompt_lookup_best": "prompt lookup, best per source"}  # fmt: skip
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
    return (
        head + "|---|---|---|---|---|---|---|---|\n" + "\n".join(lines) + _eager(evaluation) + note
    )


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


def serving(evaluation: dict) -> str:
    """The README's "Serve the drafter" launch lines filled in for this run's drafter and target
    (paths as evaluate recorded them, relative to the run's directory); '' for metrics written
    before they recorded the drafter. vLLM does not read block_size from the drafter's
    config.json: num_speculative_tokens must be block_size - 1, or it drafts a length the drafter
    never trained on, without an error."""
    drafter, target = evaluation.get("drafter"), evaluation.get("target")
    if not drafter or not target:
        return ""
    path, block = drafter["path"], drafter["block_size"]
    spec = json.dumps({"method": "dflash", "model": path, "num_speculative_tokens": block - 1})
    notes = []
    exported = Path(path) / "config.json"
    if exported.is_file():
        types = set(json.loads(exported.read_text(encoding="utf-8")).get("layer_types") or [])
        if len(types) > 1:
            notes.append("- its layers mix sliding-window and full attention: vLLM serves such a "
                         "drafter with `VLLM_USE_V2_MODEL_RUNNER=1` only")  # fmt: skip
    if (Path(path) / "mask_embedding.pt").is_file():
        notes.append("- `mask_embedding.pt` beside it holds its learned mask embedding")
    return f"""## Serve the drafter
SGLang:
```
python -m sglang.launch_server --model-path {shlex.quote(target)} \\
    --speculative-algorithm DFLASH --speculative-draft-model-path {shlex.quote(path)} \\
    --speculative-num-draft-tokens {block}
```
vLLM (num_speculative_tokens = block size {block} - 1):
```
vllm serve {shlex.quote(target)} --speculative-config {shlex.quote(spec)}
```
""" + "\n".join(notes)


def summary(rows: list[dict], evaluation: dict, prompts: dict, manifest: dict, img: str,
            extra: dict[str, dict] | None = None) -> str:  # fmt: skip
    """The Markdown summary; `img` is the plot folder relative to the Markdown file, `extra` the
    manifests of train.extra_features by path."""
    lookup = evaluation["baseline"].get("prompt_lookup", {})
    lookup_tau, ahead = lookup.get("per_source", {}), lookup.get("dflash_ahead", {})
    chosen = lookup.get("best_per_source", {})
    per_source = "\n".join(
        f"| {s} | {t:.3f} | {_fmt(lookup_tau.get(s))} | {_config(chosen.get(s))} | "
        f"{_ahead(ahead.get(s))} |"
        for s, t in sorted(evaluation["per_source"].items())
    )
    added = "".join(
        f"\n- train.extra_features {p}: {_features(m)}" for p, m in (extra or {}).items()
    )
    return f"""# dflashpipe report

## Data
- prompts: {prompts["totals"]["train"]} train, {prompts["totals"]["eval"]} eval; dropped {prompts["totals"]["dropped"]}
- features: {_features(manifest)}, layers {manifest["layer_ids"]} of {manifest["target"]["name"]}{added}

## Training
- {rows[-1]["step"]} optimizer steps{_data(rows[-1])}; final loss {rows[-1]["loss"]:.4f}; expected acceptance length {rows[-1]["expected_acceptance"]:.3f}{_held_out(rows)}{_demonstration(rows[-1])}

![loss]({img}/loss.png)
![acceptance]({img}/acceptance.png)

## Evaluation ({evaluation["num_prompts"]} prompts, {evaluation.get("run_dtype", "")}, {evaluation.get("device", "")})
| source | tau | best prompt lookup tau | its configuration | prompts where the drafter is ahead |
|---|---|---|---|---|
{per_source}

- acceptance length tau: **{evaluation["acceptance_length"]:.3f}** (prompt lookup at its best: {_fmt(lookup.get("acceptance_length"))}{_config(lookup.get("best"), ", ")})
- lossless fraction (float32): {_lossless(evaluation)}
- speedup vs target-only greedy: **{evaluation["speedup"]:.2f}x** ({_lookup_speeds(lookup)}){_engine(evaluation)}

{methods_table(evaluation)}

![histogram]({img}/histogram.png)
{f"![ddtree]({img}/ddtree.png)" if evaluation.get("ddtree") else ""}

{under_load(evaluation, img)}
{serving(evaluation)}"""


def run(train_metrics: str, eval_metrics: str, prompt_stats: str, manifest: str, plots: str,
        markdown: str, extra_manifests: list[str] = ()) -> None:  # fmt: skip
    """Write loss.png, acceptance.png, histogram.png (and ddtree.png, concurrency.png) into `plots` and the summary to `markdown`
    (the features of `extra_manifests`, train.extra_features, listed beside the run's own)."""
    out, md = Path(plots), Path(markdown)
    rows = read_training(Path(train_metrics))
    evaluation = _read_json(Path(eval_metrics))
    plot_loss(rows, out / "loss.png")
    plot_acceptance(rows, evaluation, out / "acceptance.png")
    plot_histogram(evaluation, out / "histogram.png")
    if evaluation.get("ddtree"):
        plot_ddtree(evaluation, out / "ddtree.png")
    if evaluation.get("concurrency"):
        plot_concurrency(evaluation, out / "concurrency.png")
    img = os.path.relpath(out, md.parent)
    extra = {p: _read_json(Path(p)) for p in extra_manifests}
    text = summary(
        rows, evaluation, _read_json(Path(prompt_stats)), _read_json(Path(manifest)), img, extra
    )
    with atomic_path(md) as tmp:
        tmp.write_text(text, encoding="utf-8")
