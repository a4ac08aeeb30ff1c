import json
import os
import signal
import subprocess
import sys

import pyarrow.parquet as pq
import pytest
import torch
from conftest import write_yaml
from transformers import LlamaConfig, LlamaModel

from dflashpipe.config import Config
from dflashpipe.errors import DataError
from dflashpipe.extract import (
    ExtractPaths,
    forward_taps,
    plan_batches,
    run,
    truncate_base,
)
from dflashpipe.prompts import Prompt, prompt_key, write_prompts
from dflashpipe.regenerate import RegeneratePaths
from dflashpipe.regenerate import run as regenerate
from dflashpipe.shards import FeatureShard, build_manifest, check_manifest, stats_path, verify_shard
from dflashpipe.taps import LayerTaps
from dflashpipe.target import load_target

ANSWER = "Sure. " + "This is a longer answer with several words in it. " * 3


def _raw(target_dir, tmp_path, **extract):
    return {
        "target": {"model": str(target_dir)},
        "prompts": {"sources": [{"name": "x", "kind": "jsonl", "path": "unused.jsonl"}]},
        "regenerate": {"enabled": False, "shards": 1},
        "extract": {"max_length": 512, "token_budget": 256, **extract},
        "drafter": {"target_layer_ids": [0, 1]},
    }


def _cfg(target_dir, tmp_path, **extract) -> Config:
    return Config.from_dict(_raw(target_dir, tmp_path, **extract))


@pytest.fixture
def sequences(tiny_target_dir, tmp_path):
    """A sequences shard of 12 samples of different lengths (the datasets' own answers)."""
    prompts = []
    for i in range(12):
        msgs = [{"role": "user", "content": f"Question number {i}? " + "more words " * (i * 3)}]
        prompts.append(
            Prompt(prompt_key(msgs), "t", str(i), 0, msgs, ANSWER[: 20 + 7 * i], f"f:{i}")
        )
    write_prompts(tmp_path / "train.parquet", prompts)
    out = tmp_path / "seq.parquet"
    regenerate(
        _cfg(tiny_target_dir, tmp_path),
        RegeneratePaths(str(tmp_path / "train.parquet"), 0, str(out)),
    )
    return out


def test_taps_are_hf_hidden_states_and_later_layers_do_not_run():
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=5,
                         num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    torch.manual_seed(0)
    full = LlamaModel(config).eval()
    ids = torch.randint(0, 128, (2, 9))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        ref = full(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
    base = LlamaModel(config).eval()
    base.load_state_dict(full.state_dict())
    ran = []
    for i, layer in enumerate(base.layers):
        layer.register_forward_hook(lambda *_, i=i: ran.append(i))
    truncate_base(base, 2)
    taps = LayerTaps(base, [0, 2])
    out = forward_taps(base, taps, ids)  # (2, 9, 64)
    assert ran == [0, 1, 2]  # layers 3 and 4 were never run
    expected = torch.cat([ref[1], ref[3]], dim=-1).to(torch.bfloat16)
    assert torch.equal(out, expected)


def test_batches_fit_the_budget():
    lengths = [100, 30, 250, 60, 61, 10]
    batches = plan_batches(lengths, 200)
    assert sorted(i for b in batches for i in b) == list(range(6))
    for b in batches:
        assert len(b) == 1 or len(b) * max(lengths[i] for i in b) <= 200
    assert batches[0] == [2]  # longest first


@pytest.mark.parametrize("codec", ["bf16-zstd", "fp8-zstd", "fp4-zstd", "raw"])
def test_stage_writes_decodable_shard(tiny_target_dir, sequences, tmp_path, codec):
    cfg = _cfg(tiny_target_dir, tmp_path, codec=codec)
    out = tmp_path / "features" / "shard-00000.arrow"
    run(cfg, ExtractPaths(str(sequences), 0, str(out)))
    shard = FeatureShard(out)
    assert len(shard) == 12 and shard.info.codec == codec and shard.info.layer_ids == [0, 1]
    assert shard.info.hidden_size == 64 and json.loads(stats_path(out).read_text())["samples"] == 12
    assert shard.info.group_size == (32 if codec == "fp4-zstd" else None)
    base, _ = load_target(cfg.target, torch.device("cpu"), base_only=True)
    taps = LayerTaps(base, [0, 1])
    for row in shard:
        ids = row["input_ids"].long()[None]
        ref = forward_taps(base, taps, ids)[0]  # unpadded, alone
        assert row["hidden"].shape == ref.shape == (len(ids[0]), 128)
        tol = {"fp8-zstd": 0.07, "fp4-zstd": 0.12}.get(codec, 0.01)
        assert (row["hidden"].float() - ref.float()).norm() <= tol * ref.float().norm()


def test_topk_soft_targets_are_the_targets_next_token_distribution(
    tiny_target_dir, sequences, tmp_path
):
    """extract.topk 8 with only layer 0 tapped: every layer, the final norm and the LM head still
    run, and row t of the shard's top-k is the full model's top-8 log-softmax at t."""
    raw = _raw(tiny_target_dir, tmp_path, topk=8)
    raw["drafter"]["target_layer_ids"] = [0]
    cfg = Config.from_dict(raw)
    out = tmp_path / "shard-00000.arrow"
    run(cfg, ExtractPaths(str(sequences), 0, str(out)))
    shard = FeatureShard(out)
    assert len(shard) == 12 and shard.info.topk == 8 and shard.info.layer_ids == [0]
    model, _ = load_target(cfg.target, torch.device("cpu"))  # the causal LM, head included
    taps = LayerTaps(model.get_decoder(), [0])
    for row in shard:
        ids = row["input_ids"].long()[None]
        with torch.no_grad():
            logprobs = model(ids).logits[0].float().log_softmax(-1)  # (T, V), every layer
        ids_k, lp_k = row["topk_ids"], row["topk_logprobs"]
        assert (ids_k.dtype, lp_k.dtype, ids_k.shape) == (
            torch.int32,
            torch.float16,
            (len(ids[0]), 8),
        )
        # tie-proof (random weights make near-ties, and batching moves logits by ~1e-6): the
        # stored ids carry the stored log-probs, and those are the 8 largest, in order
        close = dict(rtol=1e-3, atol=1e-3)
        torch.testing.assert_close(lp_k.float(), logprobs.gather(1, ids_k.long()), **close)
        torch.testing.assert_close(lp_k.float(), logprobs.topk(8).values, **close)
        tap = forward_taps(model.get_decoder(), taps, ids)[0]
        assert (row["hidden"].float() - tap.float()).norm() <= 0.01 * tap.float().norm()


@pytest.mark.parametrize("codec", ["bf16-zstd", "fp8-zstd"])
def test_final_hidden_is_the_targets_normed_last_state_and_gives_its_distribution(
    tiny_target_dir, sequences, tmp_path, codec
):
    """extract.final_hidden with only layer 0 tapped: every layer and the final norm run, the
    shard's rows end with the base model's output (after its last norm) as one more block,
    through the codec; the manifest records it. The KL from those stored states, through the
    head in loss.py's chunk kernel, equals a float64 reference from the target's own logits
    (bf16-zstd: the states' bf16 rounding apart; fp8-zstd: its 8-bit error apart)."""
    from dflashpipe.loss import block_labels, block_target_hidden, dflash_loss

    raw = _raw(tiny_target_dir, tmp_path, final_hidden=True, codec=codec)
    raw["drafter"]["target_layer_ids"] = [0]
    cfg = Config.from_dict(raw)
    out = tmp_path / "shard-00000.arrow"
    run(cfg, ExtractPaths(str(sequences), 0, str(out)))
    shard = FeatureShard(out)
    assert shard.info.final_hidden and shard.info.blocks == 2 and shard.info.topk == 0
    manifest = build_manifest([out])
    assert manifest["final_hidden"] is True
    verify_shard(out, manifest)
    with pytest.raises(DataError, match="final_hidden True differs from the manifest's False"):
        verify_shard(out, {k: v for k, v in manifest.items() if k != "final_hidden"})
    model, _ = load_target(cfg.target, torch.device("cpu"))
    model = model.double()
    head = model.get_output_embeddings().weight.detach()  # (V, H) float64
    H = shard.info.hidden_size
    tol = 0.01 if codec == "bf16-zstd" else 0.07
    g = torch.Generator().manual_seed(0)
    for row in list(shard)[::4]:
        ids = row["input_ids"].long()
        T = len(ids)
        with torch.no_grad():
            out_ = model(ids[None], output_hidden_states=True)
        last = out_.hidden_states[-1][0]  # (T, H) after the final norm
        stored = row["hidden"][:, -H:].double()
        assert row["hidden"].shape == (T, 2 * H)
        assert (stored - last).norm() <= tol * last.norm()
        logits = out_.logits[0]  # (T, V) float64, the target's own
        torch.testing.assert_close(last @ head.T, logits)  # the head is what the drafter holds
        # the loss: a drafter's random outputs against the stored states' distribution
        B = 4
        anchors = torch.arange(1, T - B, 3)
        labels, valid = block_labels(ids, torch.zeros(T, dtype=torch.long), torch.ones(T),
                                     anchors, torch.ones(len(anchors), dtype=torch.bool), B)  # fmt: skip
        drafter = torch.randn(len(anchors), B, H, generator=g, dtype=torch.float64) * 0.1
        target = block_target_hidden(stored.float(), anchors, B)
        loss, _ = dflash_loss(drafter.float(), head.float(), labels, valid, 4.0, chunk_rows=7,
                              distill_weight=1.0, target_hidden=target)  # fmt: skip
        at = (anchors[:, None] - 1 + torch.arange(B)).clamp(0, T - 1)  # (A, B) predicting rows
        log_p = logits[at].log_softmax(-1)  # (A, B, V) float64 from the target's logits
        log_q = (drafter @ head.T).log_softmax(-1)
        kl = (log_p.exp() * (log_p - log_q)).sum(-1)  # (A, B)
        w = torch.exp(-(torch.arange(B) - 1) / 4.0) * valid  # decay weights, slot 0 out
        ref = (w * kl).sum() / w.sum()
        assert abs(loss.item() - ref.item()) <= 5 * tol * ref.item(), (loss.item(), ref.item())
        if codec == "bf16-zstd":
            assert abs(loss.item() - ref.item()) <= 1e-3 * ref.item()


def test_manifest_records_topk_and_refuses_mixed_shards(tiny_topk_features, tiny_features):
    shards = tiny_topk_features["shards"]
    m = json.loads(tiny_topk_features["manifest"].read_text())
    assert m["topk"] == 8 and m == build_manifest(shards)
    check_manifest(m, {"topk": 8})
    for path in shards:
        verify_shard(path, m)
    with pytest.raises(
        DataError, match=r"shard-00000\.arrow: topk 8 differs from the manifest's 0"
    ):
        verify_shard(shards[0], {**m, "topk": 0})
    assert build_manifest(tiny_features["shards"])["topk"] == 0
    # the same layers, codec and target; only the soft targets differ
    with pytest.raises(DataError, match="layers/hidden size/target/topk/final_hidden differ"):
        build_manifest([shards[0], tiny_features["shards"][1]])


def test_manifest_totals_mismatch_and_checksum(tiny_target_dir, sequences, tmp_path):
    cfg = _cfg(tiny_target_dir, tmp_path)
    paths = []
    for name in ("shard-00000.arrow", "shard-00001.arrow"):
        run(cfg, ExtractPaths(str(sequences), 0, str(tmp_path / name)))
        paths.append(tmp_path / name)
    m = build_manifest(paths)
    assert m["totals"]["samples"] == 24 and m["layer_ids"] == [0, 1] and m["hidden_size"] == 64
    assert m["totals"]["tokens"] == 2 * sum(len(r["input_ids"]) for r in FeatureShard(paths[0]))
    check_manifest(m, {"layer_ids": [0, 1], "hidden_size": 64})
    with pytest.raises(DataError, match=r"layer_ids is \[0, 1\], but the consumer needs \[1, 3\]"):
        check_manifest(m, {"layer_ids": [1, 3]})
    with pytest.raises(DataError, match="target.weights_sha256"):
        check_manifest(m, {"target.weights_sha256": "0" * 64})
    verify_shard(paths[0], m)
    data = bytearray(paths[0].read_bytes())
    data[len(data) // 2] ^= 0xFF
    paths[0].write_bytes(bytes(data))
    with pytest.raises(Exception, match="does not match the manifest"):
        verify_shard(paths[0], m)


def test_overflow_truncate_and_skip(tiny_target_dir, sequences, tmp_path):
    lengths = sorted(len(r["input_ids"]) for r in pq.read_table(sequences).to_pylist())
    limit = lengths[6]
    for overflow in ("truncate", "skip"):
        out = tmp_path / f"{overflow}.arrow"
        run(
            _cfg(tiny_target_dir, tmp_path, max_length=limit, overflow=overflow),
            ExtractPaths(str(sequences), 0, str(out)),
        )
        stats = json.loads(stats_path(out).read_text())
        over = sum(n > limit for n in lengths)
        rows = list(FeatureShard(out))
        assert max(len(r["input_ids"]) for r in rows) <= limit
        if overflow == "skip":
            assert stats["skipped"]["too_long"] == over and len(rows) == 12 - over
        else:
            assert (
                stats["skipped"].get("truncated", 0) + stats["skipped"].get("too_long", 0) == over
            )


def test_nan_activations_are_skipped_and_counted(tiny_target_dir, sequences, tmp_path):
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad-target"
    bad.mkdir()
    for f in tiny_target_dir.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    weights = load_file(bad / "model.safetensors")
    rows = pq.read_table(sequences).to_pylist()
    poison = rows[3]["input_ids"][-3]  # a token of sample 3's answer
    uses = sum(poison in r["input_ids"] for r in rows)
    weights["model.embed_tokens.weight"][poison] = float("nan")
    save_file(weights, bad / "model.safetensors", metadata={"format": "pt"})
    cfg = _cfg(tiny_target_dir, tmp_path)
    cfg.raw["target"]["model"] = str(bad)
    cfg.target.model = str(bad)
    # the sequences were made with the same tokenizer but other weights: refused by default...
    with pytest.raises(DataError, match="weights_sha256"):
        run(cfg, ExtractPaths(str(sequences), 0, str(tmp_path / "x.arrow")))
    # ...so remake them with the poisoned target, then extract
    seq2 = tmp_path / "seq2.parquet"
    regenerate(cfg, RegeneratePaths(str(tmp_path / "train.parquet"), 0, str(seq2)))
    run(cfg, ExtractPaths(str(seq2), 0, str(tmp_path / "nan.arrow")))
    stats = json.loads(stats_path(tmp_path / "nan.arrow").read_text())
    assert stats["skipped"]["nan_or_inf"] == uses >= 1
    assert len(FeatureShard(tmp_path / "nan.arrow")) == 12 - uses


def test_killed_job_leaves_no_shard_and_rerun_matches(tiny_target_dir, sequences, tmp_path):
    # the 4-bit codec: its rerun must quantize to the same bytes (the mechanism is every codec's)
    extract = {"token_budget": 16, "encode_workers": 1, "codec": "fp4-zstd", "group_size": 16}
    raw = _raw(tiny_target_dir, tmp_path, **extract)
    config = write_yaml(tmp_path / "c.yaml", raw)
    cmd = [sys.executable, "-m", "dflashpipe", "extract", "--config", str(config),
           "--sequences", str(sequences), "--shard", "0"]  # fmt: skip
    whole = tmp_path / "whole" / "shard-00000.arrow"
    subprocess.run([*cmd, "--out", str(whole)], check=True, capture_output=True)
    out = tmp_path / "killed" / "shard-00000.arrow"
    # Killed at a fault point, after the third of twelve batches: a timer's guess (waiting for
    # the first bytes of the temporary file) raced with the end of the job, since the chunked
    # writer puts a small shard's bytes on disk only when it closes the file.
    env = dict(os.environ, DFLASHPIPE_KILL_AT="extract.written:3")
    killed = subprocess.run([*cmd, "--out", str(out)], env=env, capture_output=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    temps = list(out.parent.glob(".shard-00000.arrow.*.tmp"))
    assert temps, "the job never started writing"
    assert not out.exists()
    subprocess.run([*cmd, "--out", str(out)], check=True, capture_output=True)
    assert out.read_bytes() == whole.read_bytes()
    assert FeatureShard(out).info.group_size == 16


def test_sequences_of_another_tokenizer_are_refused(tiny_target_dir, sequences, tmp_path):
    table = pq.read_table(sequences)
    meta = dict(table.schema.metadata)
    target = json.loads(meta[b"target"])
    target["tokenizer_sha256"] = "f" * 64
    meta[b"target"] = json.dumps(target).encode()
    pq.write_table(table.replace_schema_metadata(meta), tmp_path / "other.parquet")
    with pytest.raises(DataError, match="tokenizer_sha256"):
        run(
            _cfg(tiny_target_dir, tmp_path),
            ExtractPaths(str(tmp_path / "other.parquet"), 0, str(tmp_path / "o.arrow")),
        )
    assert not (tmp_path / "o.arrow").exists()


def test_writer_error_at_close_does_not_hang(tmp_path, monkeypatch):
    """Chunks are written in the background, so a full disk can surface only when the shard is
    closed, after the producer's end mark: the writer must then stop, not wait for more."""
    import errno

    from dflashpipe import extract
    from dflashpipe.shards import record_batch
    from dflashpipe.storage import ChunkedFile

    class FullAtClose(ChunkedFile):
        def close(self) -> None:
            super().close()
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(extract, "ChunkedFile", FullAtClose)
    writer = extract.ShardWriter(tmp_path / "s.arrow", record_batch([]).schema, depth=2)
    writer.start()
    writer.queue.put([])  # one (empty) batch, then the end mark
    writer.queue.put(None)
    writer.join(timeout=20)
    assert not writer.is_alive(), "the writer hung after an error at close"
    assert isinstance(writer.error, OSError) and writer.error.errno == errno.ENOSPC
