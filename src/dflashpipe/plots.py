"""The report's plots, each a PNG written atomically: training loss and per-slot accuracy,
expected against measured acceptance, the acceptance histogram, DDTree's budgets and the
concurrency levels (report.py decides which apply and writes the Markdown around them).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; no display on cluster nodes
import matplotlib.pyplot as plt  # noqa: E402

from dflashpipe.storage import atomic_path  # noqa: E402


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


def plot_acceptance(
    rows: list[dict], evaluation: dict, lookup_tau: float | None, dest: Path
) -> None:
    """Expected tau from the slot accuracies against evaluate's measured tau and prompt lookup's
    at its best (`lookup_tau`: report's figure; None: metrics' overall best)."""
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["step"] for r in rows], [r["expected_acceptance"] for r in rows],
            label="expected, from training slot accuracies")  # fmt: skip
    held = [r for r in rows if "val_expected_acceptance" in r]
    if held:
        ax.plot([r["step"] for r in held], [r["val_expected_acceptance"] for r in held], "o-",
                label="expected, from held-out slot accuracies")  # fmt: skip
    ax.axhline(evaluation["acceptance_length"], color="C1", linestyle="--",
               label=f"measured tau {evaluation['acceptance_length']:.2f} (evaluate)")  # fmt: skip
    if (tau := lookup_tau) is not None:
        ax.axhline(
            tau, color="C2", linestyle=":", label=f"prompt lookup at its best, tau {tau:.2f}"
        )
    elif lookup := evaluation["baseline"].get("prompt_lookup"):  # metrics without responses
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
