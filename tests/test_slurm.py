"""The workflow on a real one-node SLURM cluster (Debian's slurm-wlm with accounting) through
the Snakemake SLURM executor and workflow/profiles/slurm: every stage is a SLURM job (sacct),
and torchrun rendezvous across two srun tasks works. The cluster
has no GPUs, so the GPU requests of the profile are overridden on the command line."""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import CLUSTER, REPO, SLURM_STATE, shared_dir, tiny_workflow_config
from filelock import FileLock

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.environ.get("DFLASHPIPE_SLURM_TESTS") != "1"
        or shutil.which("slurmctld") is None
        or shutil.which("mariadbd") is None
        or os.geteuid() != 0,
        reason="set DFLASHPIPE_SLURM_TESTS=1; needs root and Debian's slurm-wlm, slurmdbd, munge, "
        "mariadb-server (it starts and stops its own one-node cluster)",
    ),
]
GPU_RULES = ("regenerate_shard", "extract_shard", "train", "evaluate")
CPU_OVERRIDES = [
    "--default-resources", "mem_mb=1000", "runtime=10", "cpus_per_task=1",
    "--set-resources",
    *[f"{rule}:{key}={value}" for rule in GPU_RULES
      for key, value in (("gpu", 0), ("cpus_per_gpu", 0), ("mem_mb", 2000))],
    "--set-threads", *[f"{rule}=1" for rule in (*GPU_RULES, "prompts", "extract_manifest", "report")],
    "--slurm-init-seconds-before-status-checks", "1", "--seconds-between-status-checks", "1",
]  # fmt: skip


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    """One cluster for the run, started by the first test (or pytest-xdist worker) that asks and
    stopped when the whole run ends (conftest.pytest_sessionfinish): the two tests may run on
    two workers at once, and a second start would stop the first's daemons."""
    state = shared_dir(tmp_path_factory, SLURM_STATE, start_cluster)
    failed = state / "failed.txt"
    if failed.exists():  # the machine cannot run the daemons (e.g. a restricted container)
        pytest.skip(f"cannot start a one-node SLURM cluster here: {failed.read_text()[-500:]}")
    # One test at a time on the 2-CPU node: beside the workflow's jobs, the rendezvous's srun
    # waited for CPUs past its timeout. conftest.LONGEST_FIRST puts the two tests side by side,
    # so the lock rarely makes one wait.
    with FileLock(str(state / "use.lock")):
        yield state


def start_cluster(state: Path) -> None:
    started = subprocess.run([str(CLUSTER), "start", str(state)], capture_output=True, text=True)
    if started.returncode != 0:
        subprocess.run([str(CLUSTER), "stop", str(state)], check=False)
        (state / "failed.txt").write_text(started.stderr)


def _workdir(tmp_path: Path, target: Path, data_dir: Path) -> tuple[Path, Path]:
    work = tmp_path / "work"
    work.mkdir()
    return work, tiny_workflow_config(tmp_path / "tiny.yaml", target, data_dir)


def _snakemake(workdir: Path, config: Path, *targets: str) -> list[str]:
    return [sys.executable, "-m", "snakemake", *targets, "--snakefile", str(REPO / "Snakefile"),
            "--directory", str(workdir), "--workflow-profile", str(REPO / "workflow/profiles/slurm"),
            *CPU_OVERRIDES, "--configfile", str(config)]  # fmt: skip


def _jobs(since: str) -> list[tuple[str, str]]:
    """(comment, state) of the SLURM jobs submitted since `since` (sacct's job comments name
    the rule: rule_<name>_wildcards_<...>)."""
    out = subprocess.run(["sacct", "-X", "-n", "-P", "-S", since, "-o", "Comment,State"],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    return [tuple(line.split("|")) for line in out.splitlines() if line.startswith("rule_")]


def test_torchrun_rendezvous_across_two_srun_tasks(cluster, tmp_path):
    """Two srun tasks act as two nodes: each runs one torchrun agent (c10d rendezvous on the
    first task's host), world size 2 over gloo."""
    script = tmp_path / "ranks.py"
    script.write_text(
        "import torch.distributed as dist, os\n"
        "dist.init_process_group('gloo')\n"
        "t = __import__('torch').ones(1) * (dist.get_rank() + 1)\n"
        "dist.all_reduce(t)\n"
        "print(os.environ['GROUP_RANK'], dist.get_rank(), dist.get_world_size(), int(t.item()))\n"
        "dist.barrier()\n"  # as train does: leave together, before a store host can go
        "dist.destroy_process_group()\n"
    )
    from dflashpipe.launcher import torchrun_command

    cmd = torchrun_command(nodes=2, procs_per_node=1, endpoint="localhost:29533", run_id="t",
                           module=None, args=[str(script)])  # fmt: skip
    done = subprocess.run(["srun", "--ntasks=2", "--cpus-per-task=1", "--mem=1000", "--overlap", *cmd],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    lines = sorted(line.split() for line in done.stdout.splitlines() if line.strip())
    assert [line[1:] for line in lines] == [["0", "2", "3"], ["1", "2", "3"]]
    assert {line[0] for line in lines} == {"0", "1"}  # two "nodes"


def test_every_stage_is_a_slurm_job_and_a_cancelled_one_is_retried(
    cluster, tmp_path, tiny_target_dir, data_dir
):
    """The whole workflow (on the tiny target: the jobs' scheduling is under test, not the model)
    through the SLURM profile: scancel the running train job;
    Snakemake (profile: retries, squeue states) submits it again and the workflow completes.
    sacct shows every stage as a SLURM job, all COMPLETED but the cancelled attempt."""
    since = time.strftime("%Y-%m-%dT%H:%M:%S")
    workdir, config = _workdir(tmp_path, tiny_target_dir, data_dir)
    proc = subprocess.Popen(_snakemake(workdir, config), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    cancelled, deadline = None, time.time() + 900
    while cancelled is None and time.time() < deadline and proc.poll() is None:
        out = subprocess.run(
            ["squeue", "-h", "-o", "%i|%k|%T"], capture_output=True, text=True
        ).stdout
        for job_id, comment, state in (line.split("|") for line in out.splitlines() if line):
            if comment.startswith("rule_train") and state == "RUNNING":
                subprocess.run(["scancel", job_id], check=True)
                cancelled = job_id
        time.sleep(0.5)
    assert cancelled, "never saw the train job running"
    log, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, log[-3000:]
    assert (workdir / "results/drafter/model.safetensors").is_file()
    assert (
        json.loads((workdir / "results/eval/metrics.json").read_text())["lossless_fraction"] == 1.0
    )
    jobs = _jobs(since)
    rules = {comment.split("_wildcards")[0].removeprefix("rule_") for comment, _ in jobs}
    assert rules >= {"prompts", "regenerate_shard", "extract_shard", "extract_manifest", "train",
                     "evaluate", "report"}, jobs  # fmt: skip
    train = [state for comment, state in jobs if comment.startswith("rule_train")]
    assert train[0].startswith("CANCELLED") and train[-1] == "COMPLETED", train
    others = [state for comment, state in jobs if not comment.startswith("rule_train")]
    assert all(state == "COMPLETED" for state in others), jobs
