"""The Snakemake workflow as a user runs it: dry run, lint, config refusal, style, and the
embedded default end to end (retrieves its wheels from PyPI; one run, shared by the tests that
read it: conftest.default_workflow)."""

import json
import shutil
import subprocess
import sys

import pytest
import yaml
from conftest import REPO, snakemake, worker_cores, write_yaml

STAGES = sorted(p.stem for p in (REPO / "workflow" / "rules").glob("*.smk") if p.stem != "common")


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


@pytest.mark.parametrize(
    "section, key, value, message",
    [
        ("drafter", "target_layer_ids", [1, 14, 29], "drafter.target_layer_ids [1, 14, 29] "
         "taps layer 29, the last of the 30 decoder layers"),
        ("extract", "topk", 1000000, "extract.topk 1000000 is larger than the vocabulary of "
         "target resources/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf (49152 tokens)"),
    ],
)  # fmt: skip
def test_what_the_target_refuses_is_refused_before_any_job(
    smollm2_dir, tmp_path, section, key, value, message
):
    """With the target on disk (here the default's GGUF), the workflow refuses at its start what
    extract would refuse after regenerate ran: no job is planned, nothing is written."""
    raw = yaml.safe_load((REPO / "config.yaml").read_text())
    raw[section][key] = value
    bad = write_yaml(tmp_path / "bad.yaml", raw)
    (tmp_path / "resources").symlink_to(REPO / "resources")
    done = snakemake(tmp_path, "-n", "--configfile", str(bad), check=False)
    assert done.returncode != 0 and message in done.stdout + done.stderr
    assert not (tmp_path / "results").exists()


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
def test_workflow_outputs(default_workflow):
    """The default workflow's run (conftest.default_workflow, shared): two regenerate and two
    feature shards with the real SmolLM2 target, the manifest, training to an exported drafter,
    its evaluation and the report; the HTML report; a second run has nothing to do."""
    work, config = default_workflow, default_workflow / "small.yaml"
    shards = sorted((work / "results" / "sequences").glob("shard-*.parquet"))
    assert [p.name for p in shards] == ["shard-00000.parquet", "shard-00001.parquet"]
    import pyarrow.parquet as pq

    rows = [r for p in shards for r in pq.read_table(p).to_pylist()]
    assert len(rows) == 8 and all(sum(r["loss_mask"]) >= 1 for r in rows)
    assert not list((work / "results" / "sequences").glob(".*parts"))
    manifest = json.loads((work / "results" / "features" / "manifest.json").read_text())
    assert manifest["totals"]["samples"] == 8 and manifest["layer_ids"] == [1, 14, 27]
    assert manifest["hidden_size"] == 576 and manifest["codec"] == "bf16-zstd"
    assert manifest["totals"]["tokens"] == sum(len(r["input_ids"]) for r in rows)
    drafter = json.loads((work / "results" / "drafter" / "config.json").read_text())
    assert drafter["dflash_config"]["target_layer_ids"] == [1, 14, 27]
    metrics = (work / "results" / "train" / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(m)["step"] for m in metrics]
    assert steps == list(range(1, len(steps) + 1)) and 1 <= len(steps) <= 3  # max_steps 3
    evaluation = json.loads((work / "results" / "eval" / "metrics.json").read_text())
    assert evaluation["lossless_fraction"] == 1.0 and evaluation["acceptance_length"] >= 1
    assert evaluation["baseline"]["prompt_lookup"]["acceptance_length"] >= 1
    report = (work / "results" / "report.md").read_text()
    assert "lossless fraction (float32): **1.000**" in report
    assert "a demonstration of the pipeline" in report  # and names the GPU recipe (test_report)
    # --report and the rerun write only .snakemake metadata and report.html, which no other
    # test of the shared run reads
    snakemake(work, "--report", "report.html", "--configfile", str(config))
    assert (work / "report.html").stat().st_size > 10_000
    again = snakemake(work, "--cores", str(worker_cores()), "--configfile", str(config))
    assert "Nothing to be done" in again.stdout + again.stderr
    again = snakemake(work, "--cores", str(worker_cores()), "prompts", "--configfile", str(config))
    assert "Nothing to be done" in again.stdout + again.stderr


@pytest.mark.slow
def test_prompts_stage_of_the_default_workflow(default_workflow):
    """retrieve + prompts of the embedded default, for real: the whole packaged ShareGPT file
    (truncated at its end) and HumanEval, split without overlap, max_train respected."""
    out = default_workflow / "results" / "prompts"
    max_train = yaml.safe_load((default_workflow / "small.yaml").read_text())["prompts"][
        "max_train"
    ]
    stats = json.loads((out / "stats.json").read_text())
    share, he = stats["sources"]["sharegpt"], stats["sources"]["humaneval"]
    assert share["conversations"] >= 17000 and share["dropped"]["truncated_tail"] == 1
    assert share["train"] == max_train and share["eval"] >= 16
    assert he["eval"] == 164 and he["train"] == 0
    import pyarrow.parquet as pq

    train = pq.read_table(out / "train.parquet").to_pylist()
    evals = pq.read_table(out / "eval.parquet").to_pylist()
    assert len(train) == max_train
    assert {r["prompt_id"] for r in train}.isdisjoint(r["prompt_id"] for r in evals)
    assert all(r["messages"][-1]["role"] == "user" for r in train + evals)
