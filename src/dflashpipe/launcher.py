"""How the train stage starts: torchrun with one process per `devices.train` GPU (or gloo CPU
processes), one agent per node under a multi-node SLURM job. `dflashpipe.train.main` is what
each process runs. A single process on one node runs without torchrun: there is no group to
form, and the agent's interpreter (it imports torch) cost a CPU test job 4 s of its 16."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from dflashpipe.errors import DflashpipeError

if TYPE_CHECKING:
    from dflashpipe.config import Config
    from dflashpipe.devices import DeviceLease

log = logging.getLogger("dflashpipe.train")


def die_with_parent() -> None:
    """In a torchrun worker: have the kernel SIGKILL this process when its agent dies (Linux;
    elsewhere nothing). torchrun starts each worker in a session of its own, so a SIGKILL of the
    job's process group (a killed Snakemake, a lost login) reached the agent but not the
    workers: they trained on, writing into the run directory the rerun resumes from. A worker
    whose parent is no longer a torchrun agent (it died before this call) stops at once."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    try:
        cmdline = Path(f"/proc/{parent}/cmdline").read_bytes()
    except OSError:
        cmdline = b""
    if b"torch.distributed.run" not in cmdline and b"torchrun" not in cmdline:
        log.error("the torchrun agent that started this worker is gone; stopping")
        os.kill(os.getpid(), signal.SIGKILL)


def torchrun_command(nodes: int, procs_per_node: int, endpoint: str | None, run_id: str,
                     module: str | None, args: list[str]) -> list[str]:  # fmt: skip
    """torchrun for one node (--standalone) or one agent of a multi-node job (c10d rendezvous
    at `endpoint`, host:port of the first node)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={procs_per_node}"]
    if nodes == 1:
        cmd.append("--standalone")
    else:
        cmd += [
            f"--nnodes={nodes}",
            "--rdzv_backend=c10d",
            f"--rdzv_endpoint={endpoint}",
            f"--rdzv_id={run_id}",
        ]
    return cmd + (["-m", module] if module else []) + args


def _slurm_nodes() -> list[str]:
    if int(os.environ.get("SLURM_JOB_NUM_NODES", "1")) <= 1:
        return []
    out = subprocess.run(["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    return out.split()


@dataclass(frozen=True)
class TrainPaths:
    """What the train stage reads and writes: the planned config (each worker process loads it),
    the feature manifest, the run directory (checkpoints, metrics; resumed), the drafter export
    and the metrics copy. Handed to the workers as one JSON argument (`to_json`)."""

    config: Path
    manifest: Path
    run_dir: Path
    drafter: Path
    metrics: Path

    def to_json(self) -> str:
        return json.dumps({k: str(v) for k, v in asdict(self).items()})

    @classmethod
    def from_json(cls, text: str) -> TrainPaths:
        return cls(**{k: Path(v) for k, v in json.loads(text).items()})


def launch(cfg: Config, paths: TrainPaths, lease: DeviceLease) -> None:
    """Run torchrun with one process per GPU of `lease` (devices.train, each held for the whole
    run), or `train.cpu_processes` gloo processes when there is no GPU. In a multi-node SLURM job
    (train.nodes > 1), srun starts one torchrun agent per node, meeting at the first node. One
    process on one node is started directly (module docstring)."""
    from dflashpipe.leases import held_fds

    env = dict(os.environ)
    args = [paths.to_json()]
    with lease.hold_all() as devices:
        if devices is None:  # the scheduler's choice
            nproc = len(env["CUDA_VISIBLE_DEVICES"].split(","))
        else:
            nproc = len(devices) or cfg.train.cpu_processes
            if devices:
                env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, devices))
            else:
                env["DFLASHPIPE_DEVICE"] = "cpu"
        # Each process's share of the cores, unless the caller chose (torchrun would make it 1)
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
        cmd = worker_command(nproc, args, env)
        log.info("launching %s", " ".join(cmd))
        # the child keeps this job's locks (its GPUs, the run directory: cli.OUTPUT) held while
        # it lives: were the launcher killed alone, torchrun's agent or the single worker would
        # write on, and its workers die with the agent (die_with_parent)
        done = subprocess.run(cmd, env=env, pass_fds=held_fds())
    if done.returncode != 0:
        raise DflashpipeError(f"training failed (exit {done.returncode}); see the log above")


def worker_command(nproc: int, args: list[str], env: dict) -> list[str]:
    """srun over the SLURM job's nodes, torchrun on this one, or the one worker alone (`env`
    loses torchrun's variables then: train.main without WORLD_SIZE forms no group)."""
    if hosts := _slurm_nodes():
        run = torchrun_command(len(hosts), nproc, f"{hosts[0]}:29500", env["SLURM_JOB_ID"],
                               "dflashpipe.train", args)  # fmt: skip
        return ["srun", f"--nodes={len(hosts)}", f"--ntasks={len(hosts)}", "--ntasks-per-node=1",
                *run]  # fmt: skip
    if nproc > 1:
        return torchrun_command(1, nproc, None, "local", "dflashpipe.train", args)
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(key, None)
    return [sys.executable, "-m", "dflashpipe.train", *args]
