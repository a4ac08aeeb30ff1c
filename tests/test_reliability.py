"""Reliability suite, kills (issue 10): each stage job is SIGKILLed at seeded points drawn from
the fault points an uninterrupted run passes (`dflashpipe.faults`), then run again; the result
must equal the uninterrupted run's, with no temporary file left behind.

- regenerate and extract: the final shard is byte-identical to the uninterrupted one;
- train: the loss curve after the resume matches the uninterrupted one to float tolerance, and
  the run ends with the same number of steps and an export.

DFLASHPIPE_KILL_POINTS (default 10) sets the kills per stage, DFLASHPIPE_RELIABILITY_SEED the
draw; every point is printed (pytest -s) with what the killed run left behind.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import shutil
import signal
import subprocess
import traceback
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
from conftest import REPO, worker_cores

from dflashpipe import faults
from dflashpipe.config import Config

KILLS = int(os.environ.get("DFLASHPIPE_KILL_POINTS", "10"))
SEED = int(os.environ.get("DFLASHPIPE_RELIABILITY_SEED", "0"))
TEMP_PATTERNS = (".*.tmp", "*.parts", ".*.parts")


def _child(fn: Callable, args: tuple, env: dict) -> None:
    os.environ.update(env)
    faults.reset()
    try:
        fn(*args)
    except BaseException:
        traceback.print_exc()
        os._exit(1)
    os._exit(0)


def _context():
    """Jobs fork from a fork server that imported the stages once: no interpreter start-up per
    run, and no locks inherited from this (threaded) test process, which a plain fork could
    copy while held."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "transformers", "dflashpipe.regenerate",
                                "dflashpipe.extract", "dflashpipe.train", __name__])  # fmt: skip
    return ctx


def run_job(fn: Callable, *args, kill_at: str | None = None, trace: Path | None = None) -> int:
    """Run a stage job in a fresh process; its exit code (-9 when it was SIGKILLed)."""
    env = {"TOKENIZERS_PARALLELISM": "false", "TQDM_DISABLE": "1"}
    if kill_at:
        env["DFLASHPIPE_KILL_AT"] = kill_at
    if trace:
        env["DFLASHPIPE_FAULT_TRACE"] = str(trace)
    p = _context().Process(target=_child, args=(fn, args, env))
    p.start()
    p.join(timeout=600)
    if p.exitcode is None:
        p.kill()
        pytest.fail(f"job {fn.__name__} hung (kill_at={kill_at})")
    return p.exitcode


def temp_files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for pat in TEMP_PATTERNS for p in root.rglob(pat))


def leftovers(root: Path) -> str:
    """What a killed job left behind, for the printed table."""
    names = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    return ", ".join(names) or "-"


def kill_points(trace: Path, n: int, seed: int) -> list[str]:
    hits = trace.read_text().split()
    assert len(hits) >= n, f"an uninterrupted run passes only {len(hits)} points: {hits}"
    # drawn from the sorted set: threads may interleave points differently from run to run,
    # the set of points is the same, so the draw is too
    return sorted(random.Random(seed).sample(sorted(hits), n), key=hits.index)


def kill_and_rerun(tmp_path: Path, stage: str, job: Callable, prepare: Callable[[Path], None],
                   check: Callable[[Path, Path], None]) -> list[str]:  # fmt: skip
    """The reference run, then one fresh directory per kill point: kill, rerun, check."""
    ref = tmp_path / "reference"
    prepare(ref)
    trace = tmp_path / "trace.txt"
    assert run_job(job, ref, trace=trace) == 0
    passed = len(trace.read_text().split())
    report = [f"{stage}: an uninterrupted run passes {passed} fault points; killing at {KILLS}"]
    for i, point in enumerate(kill_points(trace, KILLS, SEED)):
        work = tmp_path / f"kill-{i:02d}"
        prepare(work)
        code = run_job(job, work, kill_at=point)
        assert code == -signal.SIGKILL, f"{stage}: kill at {point} gave exit code {code}"
        left = leftovers(work)
        assert run_job(job, work) == 0, f"{stage}: rerun after a kill at {point} failed"
        assert temp_files(work) == [], f"{stage}: temp files after the rerun ({point})"
        check(ref, work)
        report.append(f"{stage:<10} kill at {point:<22} left: {left}")
    print("\n" + "\n".join(report))
    return report


# ----------------------------------------------------------------------------- the jobs
def _config(work: Path, target: Path, **sections) -> Config:
    raw = {
        "target": {"model": str(target)},
        "prompts": {"sources": [{"name": "x", "kind": "jsonl", "path": "unused.jsonl"}]},
        "regenerate": {"shards": 1, "batch_size": 2, "max_new_tokens": 6, "save_every": 2},
        "extract": {"max_length": 256, "token_budget": 160, "encode_workers": 2},
        "drafter": {"target_layer_ids": [0, 1], "num_layers": 1, "block_size": 8},
    }
    for k, v in sections.items():
        raw.setdefault(k, {}).update(v)
    (work / "config.json").write_text(json.dumps(raw))
    return Config.from_dict(raw)


def regenerate_job(work: Path) -> None:
    from dflashpipe.regenerate import RegeneratePaths, run

    cfg = Config.from_dict(json.loads((work / "config.json").read_text()))
    run(cfg, RegeneratePaths(work / "train.parquet", 0, work / "out" / "shard-00000.parquet"))


def extract_job(work: Path) -> None:
    from dflashpipe.extract import ExtractPaths, run

    cfg = Config.from_dict(json.loads((work / "config.json").read_text()))
    run(cfg, ExtractPaths(work / "seq.parquet", 0, work / "out" / "shard-00000.arrow"))


def train_job(work: Path) -> None:
    from dflashpipe.launcher import TrainPaths
    from dflashpipe.train import main

    main([TrainPaths(work / "config.yaml", work / "manifest.json", work / "run",
                     work / "drafter", work / "out" / "metrics.jsonl").to_json()])  # fmt: skip


def same_bytes(ref: Path, work: Path) -> None:
    for f in sorted((ref / "out").iterdir()):
        assert (work / "out" / f.name).read_bytes() == f.read_bytes(), f"{f.name} differs"


def _prompts(path: Path, n: int) -> None:
    from dflashpipe.prompts import Prompt, prompt_key, write_prompts

    prompts = []
    for i in range(n):
        msgs = [{"role": "user", "content": f"Question {i}? " + "more words " * (i % 5)}]
        prompts.append(Prompt(prompt_key(msgs), "t", str(i), 0, msgs, "An answer.", f"f:{i}"))
    write_prompts(path, prompts)


@pytest.mark.slow
def test_regenerate_survives_kills(tmp_path, tiny_target_dir):
    def prepare(work: Path) -> None:
        work.mkdir()
        _config(work, tiny_target_dir)
        _prompts(work / "train.parquet", 10)

    kill_and_rerun(tmp_path, "regenerate", regenerate_job, prepare, same_bytes)


@pytest.mark.slow
def test_extract_survives_kills(tmp_path, tiny_target_dir, tiny_features):
    seq = tiny_features["dir"] / "seq-0.parquet"  # 12 samples of the tiny target

    def prepare(work: Path) -> None:
        work.mkdir()
        _config(work, tiny_target_dir)
        shutil.copy(seq, work / "seq.parquet")

    kill_and_rerun(tmp_path, "extract", extract_job, prepare, same_bytes)


@pytest.mark.slow
def test_train_survives_kills(tmp_path, tiny_features):
    from conftest import write_yaml

    raw = json.loads(json.dumps(tiny_features["raw"]))
    raw["train"].update(epochs=1, log_every=1, checkpoint_every=2, keep_checkpoints=2)

    def prepare(work: Path) -> None:
        work.mkdir()
        write_yaml(work / "config.yaml", raw)
        shutil.copy(tiny_features["manifest"], work / "manifest.json")

    def check(ref: Path, work: Path) -> None:
        whole = [
            json.loads(x) for x in (ref / "out" / "metrics.jsonl").read_text().split("\n") if x
        ]
        got = [json.loads(x) for x in (work / "out" / "metrics.jsonl").read_text().split("\n") if x]
        assert [r["step"] for r in got] == [r["step"] for r in whole]
        for a, b in zip(whole, got, strict=True):
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-5), a["step"]
        assert (work / "drafter" / "model.safetensors").is_file()

    kill_and_rerun(tmp_path, "train", train_job, prepare, check)


@pytest.fixture
def small_disk(tmp_path):
    """A 96 KiB tmpfs where the machine lets us mount one; else a process file-size limit
    (RLIMIT_FSIZE: writes past it fail with EFBIG, as they would on a full disk)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    mounted = (
        shutil.which("mount") is not None
        and subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=96k", "tmpfs", str(mnt)], capture_output=True
        ).returncode
        == 0  # fmt: skip
    )
    yield mnt, mounted
    if mounted:
        subprocess.run(["umount", str(mnt)], check=False)


def _extract_cli(work: Path, out: Path, limit: int | None) -> subprocess.CompletedProcess:
    import resource
    import sys

    def limit_size() -> None:
        if limit is not None:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    cfg = json.loads((work / "config.json").read_text())
    (work / "config.yaml").write_text(json.dumps(cfg))  # JSON is YAML
    argv = [sys.executable, "-m", "dflashpipe", "extract", "--config", str(work / "config.yaml"),
            "--sequences", str(work / "seq.parquet"), "--shard", "0", "--out", str(out)]  # fmt: skip
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    return subprocess.run(argv, capture_output=True, text=True, env=env, preexec_fn=limit_size)


@pytest.mark.slow
def test_extract_on_a_full_disk(tmp_path, tiny_target_dir, tiny_features, small_disk):
    """Extract into a too-small place fails with a clear message and leaves nothing behind; with
    space, a rerun completes with the same bytes as a run that never failed."""
    mnt, mounted = small_disk
    work = tmp_path / "w"
    work.mkdir()
    _config(work, tiny_target_dir)
    shutil.copy(tiny_features["dir"] / "seq-0.parquet", work / "seq.parquet")
    ref = tmp_path / "ref" / "shard-00000.arrow"
    assert _extract_cli(work, ref, None).returncode == 0
    assert ref.stat().st_size > 96 * 1024  # too big for the small place
    out = mnt / "features" / "shard-00000.arrow"
    done = _extract_cli(work, out, None if mounted else 96 * 1024)
    assert done.returncode == 2, done.stderr[-2000:]
    message = next(line for line in done.stderr.splitlines() if "error:" in line)
    assert "No space left on device" in message or "File too large" in message, message
    assert f"cannot write {out}" in message and "Free space" in message, message
    assert not out.exists() and temp_files(mnt) == [], sorted(mnt.rglob("*"))
    print(f"\nfull disk ({'tmpfs 96 KiB' if mounted else 'RLIMIT_FSIZE 96 KiB'}): {message}")
    if mounted:
        subprocess.run(["mount", "-o", "remount,size=8m", str(mnt)], check=True)
    else:
        out = tmp_path / "roomy" / "shard-00000.arrow"  # no limit: "space" again
    assert _extract_cli(work, out, None).returncode == 0
    assert out.read_bytes() == ref.read_bytes()


# ------------------------------------------------------------ killing Snakemake itself
RESUME_FLAGS = ("--rerun-incomplete",)  # README "Interrupted runs": unlock, then these


def _snakemake(work: Path, config: Path, *extra: str) -> subprocess.Popen:
    import sys

    cmd = [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--directory",
           str(work), "--configfile", str(config), "--cores", str(worker_cores()), *extra]  # fmt: skip
    log = (work.parent / f"{work.name}.log").open("a")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _cwd(proc) -> Path | None:
    try:
        return Path(proc.cwd())
    except psutil.Error:  # gone, or not ours to read
        return None


def _finished(work: Path, config: Path, *extra: str) -> None:
    p = _snakemake(work, config, *extra)
    assert p.wait(timeout=900) == 0, (work.parent / f"{work.name}.log").read_text()[-4000:]


@pytest.mark.slow
def test_killed_snakemake_resumes(tmp_path, tiny_target_dir, data_dir):
    """SIGKILL the Snakemake process group (Snakemake and its running jobs, as when a login
    session or node dies) at seeded moments, one kill per attempt in the same run directory,
    each followed by `snakemake --unlock` and a rerun with --rerun-incomplete (which the next
    kill cuts short again): no job outlives its group, and the last rerun completes the
    workflow with the uninterrupted run's shards, the same loss curve, and no temporary
    files."""
    import time

    from conftest import tiny_workflow_config

    config = tiny_workflow_config(tmp_path / "workflow.yaml", tiny_target_dir, data_dir)
    ref = tmp_path / "reference"
    ref.mkdir()
    start = time.monotonic()
    _finished(ref, config)
    took = time.monotonic() - start
    rng = random.Random(SEED)
    kills = int(os.environ.get("DFLASHPIPE_SNAKEMAKE_KILLS", "2"))
    work = tmp_path / "killed"
    work.mkdir()
    report, spent = [], 0.0
    for i in range(kills):
        # an attempt resumes where the last one stopped, so its kill lands later in the workflow.
        # The earlier attempts ran `spent` seconds, so at least took - spent of the work is left
        # (a kill loses its running jobs' part): a delay under half of that leaves the attempt
        # work to be cut short in, also where the reference run was twice as slow as this one
        # (CI's other tests beside it). A draw under half the whole run's time did not: the
        # second attempt once finished before its kill.
        delay = rng.uniform(0.1, 0.9) * (took - spent) / 2
        spent += delay
        p = _snakemake(work, config, *(RESUME_FLAGS if i else ()))
        time.sleep(delay)
        assert p.poll() is None, f"attempt {i} finished before its kill at {delay:.1f} s"
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        time.sleep(0.5)
        left = [q.cmdline() for q in psutil.process_iter() if _cwd(q) == work]
        assert not left, f"jobs outlived the killed Snakemake: {left}"
        done = sorted(str(f.relative_to(work / "results")) for f in (work / "results").rglob("*")
                      if f.is_file() and "logs" not in f.parts and "benchmarks" not in f.parts)  # fmt: skip
        report.append(f"snakemake  attempt {i} killed at {delay:5.1f} s (whole run {took:.1f} s); "
                      f"finished by then: {len(done)} files ({', '.join(done[-3:]) or '-'} ...)")  # fmt: skip
        _finished(work, config, "--unlock")
    _finished(work, config, *RESUME_FLAGS)
    for rel in ("sequences/shard-00000.parquet", "sequences/shard-00001.parquet",
                "features/shard-00000.arrow", "features/shard-00001.arrow"):  # fmt: skip
        assert (work / "results" / rel).read_bytes() == (ref / "results" / rel).read_bytes(), rel
    whole = [json.loads(x) for x in (ref / "results/train/metrics.jsonl").read_text().splitlines()]
    got = [json.loads(x) for x in (work / "results/train/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in got] == [r["step"] for r in whole]
    for a, b in zip(whole, got, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-5), a["step"]
    assert (work / "results" / "report.md").is_file()
    assert temp_files(work / "results") == []
    print("\n" + "\n".join(report))


# ------------------------------------------------------------ two writers of one output
def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}  # fmt: skip


def test_a_second_trainer_of_a_run_directory_is_refused(tmp_path, tiny_features):
    """Issue 60 item 3: a train job still runs (orphaned by a `kill -9` of Snakemake alone), and
    a rerun starts train again on the same run directory. The second fails at once (exit 2)
    naming the first's PID and host, and changes nothing of the first's files; once the first
    job is SIGKILLed, its lock goes with it. 8254850 let the second train into the same run
    directory (metrics.jsonl interleaved two runs' steps)."""
    import socket
    import sys
    import time

    from conftest import write_yaml

    from dflashpipe.leases import hold_output

    raw = json.loads(json.dumps(tiny_features["raw"]))
    raw["train"].update(checkpoint_every=1, cpu_processes=1)
    config = write_yaml(tmp_path / "config.yaml", raw)
    work = tmp_path / "results"
    cmd = [sys.executable, "-m", "dflashpipe", "train", "--config", str(config), "--manifest",
           str(tiny_features["manifest"]), "--run-dir", str(work / "train" / "run"), "--drafter",
           str(work / "drafter"), "--metrics", str(work / "train" / "metrics.jsonl")]  # fmt: skip
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", TQDM_DISABLE="1")
    log = (tmp_path / "first.log").open("w")
    first = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                             start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not (work / "train" / "run" / "step-00000001").is_dir():
            assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the first trainer wrote no checkpoint"
            time.sleep(0.05)
        # its files hold still: only the second trainer may change them now
        os.killpg(first.pid, signal.SIGSTOP)
        before = _files(work)
        second = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
        assert second.returncode == 2, second.stderr[-3000:]
        message = next(line for line in second.stderr.splitlines() if "error:" in line)
        assert f"process {first.pid} on host {socket.gethostname()}" in message, message
        assert str(work / "train" / "run") in message, message
        assert _files(work) == before
        print(f"\nsecond trainer: {message}")
    finally:
        job = [psutil.Process(first.pid), *psutil.Process(first.pid).children(recursive=True)]
        os.killpg(first.pid, signal.SIGKILL)  # the launcher and its worker, stopped or not
        first.wait()
        assert not psutil.wait_procs(job, timeout=30)[1]
    with hold_output(work / "train" / "run"):  # the kernel released the lock with the job
        pass
