"""How the train stage starts: torchrun with one process per `devices.train` GPU (or gloo CPU
processes), one agent per node under a multi-node SLURM job. `dflashpipe.train.main` is what
each process runs. A single process on one node runs without torchrun: there is no group to
form, and the agent's interpreter (it imports torch) cost a CPU test job 4 s of its 16."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path

from dflashpipe.config import load_config
from dflashpipe.errors import DflashpipeError

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


def launch(config_path: str, manifest: str, run_dir: str, drafter: str, metrics: str) -> None:
    """Run torchrun with one process per `devices.train` GPU (held by leases for the whole run),
    or `train.cpu_processes` gloo processes when there is no GPU. In a multi-node SLURM job
    (train.nodes > 1), srun starts one torchrun agent per node, meeting at the first node. One
    process on one node is started directly (module docstring)."""
    from dflashpipe.devices import resolve_devices, scheduler_assigned, visible_gpus
    from dflashpipe.leases import held_fds, lease_device

    cfg = load_config(config_path)
    env = dict(os.environ)
    args = ["--config", config_path, "--manifest", manifest, "--run-dir", run_dir,
            "--drafter", drafter, "--metrics", metrics]  # fmt: skip
    with ExitStack() as leases:
        if scheduler_assigned():
            nproc = len(env["CUDA_VISIBLE_DEVICES"].split(","))
        else:
            devices = resolve_devices(cfg.devices.train, visible_gpus(), "devices.train")
            for d in devices:
                leases.enter_context(lease_device([d], d))
            nproc = len(devices) or cfg.train.cpu_processes
            if devices:
                env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, devices))
            else:
                env["DFLASHPIPE_DEVICE"] = "cpu"
        # Each process's share of the cores, unless the caller chose (torchrun would make it 1)
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
        if hosts := _slurm_nodes():
            run = torchrun_command(
                len(hosts),
                nproc,
                f"{hosts[0]}:29500",
                env["SLURM_JOB_ID"],
                "dflashpipe.train",
                args,
            )
            cmd = [
                "srun",
                f"--nodes={len(hosts)}",
                f"--ntasks={len(hosts)}",
                "--ntasks-per-node=1",
                *run,
            ]
        elif nproc > 1:
            cmd = torchrun_command(1, nproc, None, "local", "dflashpipe.train", args)
        else:  # train.main without WORLD_SIZE: no process group, world 1
            cmd = [sys.executable, "-m", "dflashpipe.train", *args]
            for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
                env.pop(key, None)
        log.info("launching %s", " ".join(cmd))
        # the child keeps this job's locks (its GPUs, the run directory: cli.OUTPUT) held while
        # it lives: were the launcher killed alone, torchrun's agent or the single worker would
        # write on, and its workers die with the agent (die_with_parent)
        done = subprocess.run(cmd, env=env, pass_fds=held_fds())
    if done.returncode != 0:
        raise DflashpipeError(f"training failed (exit {done.returncode}); see the log above")
