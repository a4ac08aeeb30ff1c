"""Device exclusivity with a fake pool of devices on CPU: real processes, real flocks."""

import json
import multiprocessing as mp
import time

from dflashpipe.leases import lease_device


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
