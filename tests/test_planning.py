"""What a `snakemake` start decides before any job runs, as a new user meets it (issue 60): a file
the config names that is not there is refused, naming the key, the path and the config file; a
dry run beside a finished (or running) workflow writes nothing under results/; a forced stage
cut off by a kill resumes on the README's command; config errors carry no traceback.

Each test copies the shared finished default run (conftest.default_workflow) and plans against
the copy with this checkout's Snakefile; each fails on 8254850's behaviour (tests/RELIABILITY.md).
"""

import re
import shutil
import subprocess
import sys

import pytest
import yaml
from conftest import REPO, snakemake, write_yaml

pytestmark = pytest.mark.slow


@pytest.fixture
def finished(default_workflow, tmp_path):
    """A copy of the finished default run (its .snakemake metadata too) and its config."""
    work = tmp_path / "run"
    shutil.copytree(default_workflow, work, symlinks=True)
    return work, yaml.safe_load((work / "small.yaml").read_text())


def snapshot(results):
    """Every path under results/ with its size and mtime."""
    return {
        str(p.relative_to(results)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(results.rglob("*"))
    }


def planned_rules(out):
    """The rules of Snakemake's job table; empty when it has nothing to do."""
    if "Nothing to be done" in out:
        return set()
    table = out[out.index("Job stats:") :].split("\n\n")[0]
    return {m.group(1) for m in re.finditer(r"^(\w+)\s+\d+$", table, re.M)} - {"total", "all"}


@pytest.mark.parametrize("which", ["source", "exclude", "local-target"])
def test_a_missing_named_file_is_refused_before_any_job(finished, which):
    """A prompt source, an exclude file or a local target that is not there: a dry run, a real
    run and check-config refuse at once, naming the key, the path and the config file, and no
    output of the finished run is removed (before: "Nothing to be done" and exit 0 for the
    source; for the target the run failed 6 s in, after regenerate's shard was removed)."""
    work, raw = finished
    if which == "source":
        raw["prompts"]["sources"][1]["path"] = "data/my_humaneval.jsonl.gz"
        key, path = "prompts.sources[1] 'humaneval' path", "data/my_humaneval.jsonl.gz"
    elif which == "exclude":
        raw["prompts"]["exclude"] = ["elsewhere/train.parquet"]
        key, path = "prompts.exclude[0]", "elsewhere/train.parquet"
    else:
        raw["target"] = {"model": "/models/SmolLM2-135M-Instruct"}
        key, path = "target.model", "/models/SmolLM2-135M-Instruct"
    bad = write_yaml(work / "bad.yaml", raw)
    before = snapshot(work / "results")
    message = f"{bad}: names files that are not there"
    for args in (["-n"], ["--cores", "1"]):
        done = snakemake(work, *args, "--configfile", str(bad), check=False)
        out = done.stdout + done.stderr
        assert done.returncode == 1, out[-2000:]
        assert message in out and f"{key}: {path} does not exist" in out, out[-2000:]
        assert "Traceback" not in out and "common.smk" not in out, out[-2000:]
    assert snapshot(work / "results") == before
    cli = subprocess.run(
        [sys.executable, "-m", "dflashpipe", "check-config", "--config", str(bad)],
        capture_output=True, text=True, cwd=work,
    )  # fmt: skip
    assert cli.returncode == 2 and f"{key}: {path} does not exist" in cli.stderr, cli.stderr


def test_a_dry_run_with_another_config_leaves_results_untouched(finished):
    """`snakemake -n --configfile other.yaml` beside a finished (or running) workflow writes
    nothing under results/ (before: it rewrote results/config.resolved.yaml, which every later
    job of a running workflow reads). Its jobs would read the config they were planned with,
    stored under its own digest when a real run starts, not the running one's."""
    work, raw = finished
    raw["prompts"]["max_train"] += 1
    other = write_yaml(work / "other.yaml", raw)
    before = snapshot(work / "results")
    done = snakemake(work, "-n", "-p", "--configfile", str(other))
    out = done.stdout + done.stderr
    assert "prompts" in planned_rules(out)
    assert snapshot(work / "results") == before
    configs = set(re.findall(r"--config (results/configs/[0-9a-f]{16}\.yaml)", out))
    assert len(configs) == 1, out[-2000:]
    planned = work / configs.pop()
    assert not planned.exists()  # written when a real run starts (onstart), not by planning
    assert planned.parent.is_dir() and len(list(planned.parent.glob("*.yaml"))) == 1


def test_a_forced_stage_cut_off_resumes_on_rerun_incomplete(finished):
    """`--forcerun train` on a finished run, killed (`kill -9` of Snakemake and its job) after
    Snakemake removed train's outputs: the README's `snakemake --cores all --rerun-incomplete`
    plans train and what follows it (before: "Nothing to be done", results/drafter/ empty and
    the report describing the old drafter). The kill's state is made directly here: the forced
    job's outputs gone, everything else of the finished run in place."""
    work, _ = finished
    for name in ("drafter/config.json", "drafter/model.safetensors", "train/metrics.jsonl"):
        (work / "results" / name).unlink()
    done = snakemake(work, "-n", "--rerun-incomplete", "--configfile", str(work / "small.yaml"))
    assert planned_rules(done.stdout + done.stderr) == {"train", "evaluate", "report"}
    # the stage targets too: a cut-off regenerate shard under `snakemake extract`
    (work / "results" / "sequences" / "shard-00001.parquet").unlink()
    done = snakemake(
        work, "extract", "-n", "--rerun-incomplete", "--configfile", str(work / "small.yaml")
    )
    assert planned_rules(done.stdout + done.stderr) == {
        "regenerate_shard", "extract_shard", "extract_manifest", "extract"
    }  # fmt: skip


def test_a_config_error_names_the_config_file_without_a_traceback(tmp_path):
    raw = yaml.safe_load((REPO / "config.yaml").read_text())
    raw["extract"]["codek"] = "raw"
    bad = write_yaml(tmp_path / "mine.yaml", raw)
    done = snakemake(tmp_path, "-n", "--configfile", str(bad), check=False)
    out = done.stdout + done.stderr
    assert done.returncode == 1
    assert f"{bad} is not valid:\n  extract: unknown key(s) ['codek']" in out, out
    assert "Traceback" not in out and "line " not in out, out
