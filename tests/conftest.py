"""Shared fixtures: small real files of every prompt source kind, and config builders."""

from __future__ import annotations

import copy
import gzip
import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

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
