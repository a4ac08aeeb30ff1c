"""Device exclusivity with a fake pool of devices on CPU, and output locks: real processes, real
flocks."""

import json
import multiprocessing as mp
import socket
import subprocess
import sys
import time

import psutil
import pytest

from dflashpipe.errors import OutputBusyError
from dflashpipe.leases import hold_output, lease_device


def _job(lock_dir, pool, preferred, log_path, hold_s):
    with lease_device(pool, preferred, lock_dir, poll_s=0.01) as device:
        start = time.monotonic()
        time.sleep(hold_s)
        end = time.monotonic()
    with open(log_path, "a") as f:
        f.write(json.dumps({"device": device, "start": start, "end": end}) + "\n")


def test_no_two_jobs_share_a_device(tmp_path):
    pool, log_path = [0, 1], tmp_path / "leases.jsonl"
    ctx = mp.get_context("spawn")
    jobs = [
        ctx.Process(target=_job, args=(tmp_path / "locks", pool, i % 2, log_path, 0.3))
        for i in range(6)
    ]
    for j in jobs:
        j.start()
    for j in jobs:
        j.join(timeout=60)
        assert j.exitcode == 0
    spans = [json.loads(line) for line in log_path.read_text().splitlines()]
    assert len(spans) == 6 and {s["device"] for s in spans} == {0, 1}
    for d in pool:
        on_d = sorted((s["start"], s["end"]) for s in spans if s["device"] == d)
        for (_, end), (start, _) in zip(on_d, on_d[1:], strict=False):
            assert start >= end, f"two jobs overlapped on device {d}: {on_d}"
    # six 0.3 s jobs on two devices cannot finish faster than three rounds
    assert max(s["end"] for s in spans) - min(s["start"] for s in spans) >= 0.85


def test_busy_preferred_device_gives_another(tmp_path):
    with (
        lease_device([0, 1, 2], 1, tmp_path) as first,
        lease_device([0, 1, 2], 1, tmp_path) as second,
    ):
        assert first == 1 and second in (0, 2)


def test_lease_released_when_process_dies(tmp_path):
    ctx = mp.get_context("spawn")
    p = ctx.Process(target=_job, args=(tmp_path, [0], 0, tmp_path / "log.jsonl", 30))
    p.start()
    while not (tmp_path / "gpu-0.lock").exists() or (tmp_path / "gpu-0.lock").read_text() == "":
        time.sleep(0.05)
    p.kill()
    p.join()
    with lease_device([0], 0, tmp_path, poll_s=0.01) as device:
        assert device == 0


# ------------------------------------------------------------------ output locks (issue 60)
HOLDER = """
import subprocess, sys, time
from dflashpipe.leases import held_fds, hold_output
with hold_output(sys.argv[1]):
    child = None
    if sys.argv[2] == "child":  # as the launcher starts torchrun: handing it the job's locks
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                                 pass_fds=held_fds())
    print(child.pid if child else "held", flush=True)
    time.sleep(600)
"""


def _holder(output, child: bool) -> tuple[subprocess.Popen, str]:
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(output), "child" if child else "-"],
                         stdout=subprocess.PIPE, text=True)  # fmt: skip
    return p, p.stdout.readline().strip()


def test_a_second_writer_of_an_output_is_refused_naming_the_holder_until_it_dies(tmp_path):
    out = tmp_path / "features" / "shard-00000.arrow"
    holder, _ = _holder(out, child=False)
    try:
        with pytest.raises(OutputBusyError) as info, hold_output(out):
            pass
        message = str(info.value)
        assert f"process {holder.pid} on host {socket.gethostname()}" in message, message
        assert str(out) in message and "kill" in message and ".shard-00000.arrow.lock" in message
    finally:
        holder.kill()  # SIGKILL: no cleanup of its own; the kernel drops the lock
        holder.wait()
    with hold_output(out):  # the killed holder's file, now free
        assert (tmp_path / "features" / ".shard-00000.arrow.lock").is_file()
    assert list(out.parent.iterdir()) == []  # a job that ends leaves nothing beside its output


def test_a_child_handed_the_locks_keeps_them_after_its_launcher_dies(tmp_path):
    """The train launcher's case: torchrun (here a sleeping child) still runs, so the run
    directory stays locked though the process that took the lock was SIGKILLed."""
    run_dir = tmp_path / "train" / "run"
    holder, child_pid = _holder(run_dir, child=True)
    child = psutil.Process(int(child_pid))
    holder.kill()
    holder.wait()
    try:
        busy = pytest.raises(OutputBusyError, match=f"process {holder.pid} .*or one it started")
        with busy, hold_output(run_dir):
            pass
    finally:
        child.kill()
        child.wait()
    with hold_output(run_dir):
        pass


def _writer(output, log_path, rounds):
    spans = []
    while len(spans) < rounds:
        try:
            with hold_output(output):
                start = time.monotonic()
                time.sleep(0.003)
                spans.append((start, time.monotonic()))
        except OutputBusyError:
            time.sleep(0.001)
    with open(log_path, "a") as f:
        f.writelines(json.dumps(s) + "\n" for s in spans)


def test_writers_taking_turns_never_overlap(tmp_path):
    """Each writer removes the lock file as it lets go; one that opened the old file meanwhile
    must not count that as holding the lock beside a writer of the new file."""
    ctx, log_path = mp.get_context("spawn"), tmp_path / "spans.jsonl"
    jobs = [ctx.Process(target=_writer, args=(tmp_path / "out", log_path, 30)) for _ in range(4)]
    for j in jobs:
        j.start()
    for j in jobs:
        j.join(timeout=60)
        assert j.exitcode == 0
    spans = sorted(tuple(json.loads(line)) for line in log_path.read_text().splitlines())
    assert len(spans) == 120
    for (_, end), (start, _) in zip(spans, spans[1:], strict=False):
        assert start >= end, "two writers held one output at once"
