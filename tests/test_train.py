"""The train stage on CPU through torchrun (gloo): export, resume after a kill, refusals."""

import dataclasses
import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
import yaml
from conftest import write_yaml

from dflashpipe import checkpoint
from dflashpipe.config import Config, load_config
from dflashpipe.data import Sample, split_validation
from dflashpipe.devices import DeviceLease
from dflashpipe.errors import ConfigError, DataError
from dflashpipe.export import load_drafter
from dflashpipe.launcher import TrainPaths, launch
from dflashpipe.train import Trainer


def _train(tmp_path, tiny_features, name, **train):
    raw = json.loads(json.dumps(tiny_features["raw"]))
    raw["train"].update(train)
    config = write_yaml(tmp_path / f"{name}.yaml", raw)
    out = tmp_path / name
    args = [str(config), str(tiny_features["manifest"]), str(out / "run"), str(out / "drafter"),
            str(out / "metrics.jsonl")]  # fmt: skip
    return args, out


def _launch(*args: str) -> None:
    """The train stage as its command runs it: the launcher over devices.train."""
    cfg = load_config(args[0])
    launch(cfg, TrainPaths(*map(Path, args)), DeviceLease(cfg.devices.train, key="devices.train"))


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_train_exports_a_drafter_and_learns(tmp_path, tiny_features, tiny_target_dir):
    args, out = _train(tmp_path, tiny_features, "a")
    _launch(*args)
    rows = _rows(out / "metrics.jsonl")
    assert rows[-1]["loss"] < rows[0]["loss"]
    assert len(rows[0]["slot_accuracy"]) == 7 and rows[0]["expected_acceptance"] >= 1
    cfg = json.loads((out / "drafter" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["dflash_config"][
        "target_layer_ids"
    ] == [0, 1]
    from safetensors.torch import load_file

    target = load_file(tiny_target_dir / "model.safetensors")
    embed = target["model.embed_tokens.weight"]
    drafter = load_drafter(out / "drafter", embed, target.get("lm_head.weight", embed))
    assert drafter.config.block_size == 8 and drafter.config.num_layers == 1
    # the mask token was chosen automatically: a special token absent from the data
    assert cfg["dflash_config"]["mask_token_id"] not in {0, 1, 2}


def test_drafter_can_start_from_the_targets_last_layers(tmp_path, tiny_features, tiny_target_dir):
    """drafter.init target-layers: one step at a negligible learning rate exports (almost) the
    target's last decoder layer and final norm."""
    from safetensors.torch import load_file

    raw = json.loads(json.dumps(tiny_features["raw"]))
    raw["drafter"]["init"] = "target-layers"
    raw["train"].update(lr=1e-12, max_steps=1)
    config = write_yaml(tmp_path / "init.yaml", raw)
    out = tmp_path / "init"
    _launch(str(config), str(tiny_features["manifest"]), str(out / "run"), str(out / "drafter"),
           str(out / "metrics.jsonl"))  # fmt: skip
    mine = load_file(out / "drafter" / "model.safetensors")
    theirs = load_file(tiny_target_dir / "model.safetensors")
    for name in ("self_attn.q_proj.weight", "mlp.gate_proj.weight", "input_layernorm.weight"):
        a, b = mine[f"layers.0.{name}"], theirs[f"model.layers.2.{name}"]
        assert torch.allclose(a.float(), b.to(a.dtype).float(), atol=1e-6), name  # export dtype
    norm = mine["norm.weight"]
    assert torch.allclose(norm.float(), theirs["model.norm.weight"].to(norm.dtype).float())
    assert not torch.allclose(  # another layer of the target is not the one taken
        mine["layers.0.mlp.gate_proj.weight"].float(), theirs["model.layers.0.mlp.gate_proj.weight"]
    )


def test_extra_features_are_trained_on_but_never_held_out(tmp_path, tiny_features):
    """train.extra_features: another manifest's shards (here a copy) join the training samples;
    the held-out samples stay the stage's own; a mismatched or corrupt extra set is refused."""
    import shutil

    from dflashpipe.errors import IntegrityError

    extra = tmp_path / "extra"
    extra.mkdir()
    for path in [*tiny_features["shards"], tiny_features["manifest"]]:
        shutil.copy(path, extra / path.name)
    raw = json.loads(json.dumps(tiny_features["raw"]))
    raw["train"]["val_samples"] = 4

    def trainer(run: str, **train) -> Trainer:
        cfg = Config.from_dict({**raw, "train": {**raw["train"], **train}})
        return Trainer(cfg, tiny_features["manifest"], tmp_path / run, torch.device("cpu"))

    alone = trainer("a")
    both = trainer("b", extra_features=[str(extra / "manifest.json")])
    own = len(alone.shards)
    assert both.shards[own:] == [extra / p.name for p in tiny_features["shards"]]
    assert both.val_samples == alone.val_samples and all(s.shard < own for s in both.val_samples)
    added = [s for s in both.samples if s.shard >= own]
    assert len(added) == len(alone.samples) + len(alone.val_samples)  # all of the copy trains
    assert both.samples[: len(alone.samples)] == alone.samples
    assert both.fingerprint["train.extra_features"] == [str(extra / "manifest.json")]

    manifest = json.loads((extra / "manifest.json").read_text())
    (extra / "other.json").write_text(json.dumps({**manifest, "layer_ids": [0]}))
    with pytest.raises(DataError, match="other.json: feature manifest layer_ids is"):
        trainer("c", extra_features=[str(extra / "other.json")])
    with open(extra / tiny_features["shards"][1].name, "r+b") as f:
        f.seek(-100, 2)
        f.write(b"x" * 8)
    with pytest.raises(IntegrityError, match="does not match the manifest"):
        trainer("d", extra_features=[str(extra / "manifest.json")])


def test_adamw_betas_come_from_the_config(tmp_path, tiny_features):
    raw = json.loads(json.dumps(tiny_features["raw"]))
    raw["train"].pop("betas", None)
    assert Config.from_dict(raw).raw["train"]["betas"] == [0.9, 0.95]  # the default
    raw["train"]["betas"] = [0.9, 0.999]
    cfg = Config.from_dict(raw)
    trainer = Trainer(cfg, tiny_features["manifest"], tmp_path / "b", torch.device("cpu"))
    assert trainer.optimizer.param_groups[0]["betas"] == (0.9, 0.999)
    raw["train"]["betas"] = [0.9, 1.0]
    with pytest.raises(ConfigError, match="betas"):
        Config.from_dict(raw)


def test_train_distills_the_targets_top_k(tmp_path, tiny_topk_features, tiny_features):
    """train.distill_weight 0.5 on shards with top-8 soft targets: the stage's entry point trains
    (held-out passes included) and exports; a batch's loss is (1 - d) x its hard loss + d x its
    KL; shards without soft targets are refused, named."""
    from dflashpipe.data import PackedBatches, epoch_plan, index_samples
    from dflashpipe.objective import forward_loss
    from dflashpipe.train import main

    raw = json.loads(json.dumps(tiny_topk_features["raw"]))
    raw["train"].update(distill_weight=0.5, max_steps=4, log_every=1, val_samples=4, val_every=2)
    config = write_yaml(tmp_path / "distill.yaml", raw)
    manifest, out = tiny_topk_features["manifest"], tmp_path / "distill"
    main(
        [
            TrainPaths(
                config, manifest, out / "run", out / "drafter", out / "metrics.jsonl"
            ).to_json()
        ]
    )
    rows = _rows(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and rows[-1]["loss"] < rows[0]["loss"]
    assert [r["step"] for r in rows if "val_loss" in r] == [2, 4]
    assert (out / "drafter" / "model.safetensors").is_file()

    trainer = Trainer(Config.from_dict(raw), manifest, tmp_path / "fresh", torch.device("cpu"))
    plan = epoch_plan(trainer.samples, trainer.tokens, 0, 0, 0, 1)
    batch = PackedBatches(trainer.shards, trainer.samples, plan, trainer.tokens, 16, 0, 0, 8)[0]
    assert batch["topk_ids"].shape == (trainer.tokens, 8)
    with torch.no_grad():
        hard, kl, mixed = (
            forward_loss(trainer.model, trainer.head, batch, 8, trainer.gamma, d)[0].item()
            for d in (0.0, 1.0, 0.5)
        )
    assert kl > 0 and abs(kl - hard) > 0.1
    assert mixed == pytest.approx(0.5 * hard + 0.5 * kl, rel=1e-5)
    with pytest.raises(
        DataError, match=r"shard-00000\.arrow has no soft targets .*extract\.topk 8"
    ):
        index_samples(tiny_features["shards"], trainer.tokens, {}, topk=8)


def test_train_with_the_ranking_term(tmp_path, tiny_features):
    """train.rank_weight 0.3 (issue 24's tree-aware term): the stage's entry point trains and
    exports; a batch's loss is 0.7 x its cross-entropy + 0.3 x its ranking term, which is > 0;
    the term's shares beside distill_weight are checked at config time."""
    from dflashpipe.data import PackedBatches, epoch_plan
    from dflashpipe.objective import forward_loss
    from dflashpipe.train import main

    raw = json.loads(json.dumps(tiny_features["raw"]))
    raw["train"].update(rank_weight=0.3, rank_k=4, max_steps=3, log_every=1)
    config = write_yaml(tmp_path / "rank.yaml", raw)
    out = tmp_path / "rank"
    paths = TrainPaths(config, tiny_features["manifest"], out / "run", out / "drafter",
                       out / "metrics.jsonl")  # fmt: skip
    main([paths.to_json()])
    assert [r["step"] for r in _rows(out / "metrics.jsonl")] == [1, 2, 3]
    assert (out / "drafter" / "model.safetensors").is_file()
    trainer = Trainer(Config.from_dict(raw), tiny_features["manifest"], tmp_path / "fresh",
                      torch.device("cpu"))  # fmt: skip
    assert (trainer.fingerprint["train.rank_weight"], trainer.fingerprint["train.rank_k"]) == (
        0.3,
        4,
    )
    plan = epoch_plan(trainer.samples, trainer.tokens, 0, 0, 0, 1)
    batch = PackedBatches(trainer.shards, trainer.samples, plan, trainer.tokens, 16, 0, 0)[0]
    with torch.no_grad():
        ce, rank, mixed = (
            forward_loss(trainer.model, trainer.head, batch, 8, trainer.gamma, 0.0, (r, 4))[0]
            for r in (0.0, 1.0, 0.3)
        )
    assert rank.item() > 0 and abs(rank.item() - ce.item()) > 0.1
    assert mixed.item() == pytest.approx(0.7 * ce.item() + 0.3 * rank.item(), rel=1e-5)
    raw["train"].update(distill_weight=0.8)
    with pytest.raises(
        ConfigError, match=r"distill_weight 0\.8 \+ train\.rank_weight 0\.3 is over 1"
    ):
        Config.from_dict(raw)


def test_sample_fraction_trains_on_a_seeded_share(tmp_path, tiny_features):
    """train.sample_fraction 0.5: half the training samples, a subset of all of them and the
    same one every time; the held-out samples do not change; another fingerprint."""
    raw = json.loads(json.dumps(tiny_features["raw"]))
    raw["train"].update(val_samples=4)
    full = Trainer(Config.from_dict(raw), tiny_features["manifest"], tmp_path / "a",
                   torch.device("cpu"))  # fmt: skip
    raw["train"].update(sample_fraction=0.5)
    half, again = (
        Trainer(Config.from_dict(raw), tiny_features["manifest"], tmp_path / d, torch.device("cpu"))
        for d in ("b", "c")
    )
    assert len(half.samples) == round(len(full.samples) / 2) > 0
    assert all(s in full.samples for s in half.samples) and half.samples == again.samples
    assert half.val_samples == full.val_samples
    assert (
        half.fingerprint["train.sample_fraction"]
        == 0.5
        != full.fingerprint["train.sample_fraction"]
    )
    raw["train"].update(sample_fraction=0)
    with pytest.raises(ConfigError, match="sample_fraction"):
        Config.from_dict(raw)


def test_two_processes(tmp_path, tiny_features):
    """DDP over two processes on a DFlash2 drafter (the DFlash backbone plus its convolutions and
    selector; DFlash alone under DDP: test_fsdp_matches_ddp_and_resumes_after_a_kill), the
    selector's term at alpha 0 on the first step (its warm-up: every parameter must still
    reach the reducer) and on after it (gold tokens outside the untrained top K replace the
    weakest, so the term is not empty): trains, reduces the held-out figures, exports DFlash2."""
    args, out = _train(tmp_path, tiny_features, "ddp", cpu_processes=2, epochs=1, val_samples=8,
                       selector={"warmup_steps": 1, "outside_top_k": "replace"})  # fmt: skip
    raw = yaml.safe_load(Path(args[0]).read_text())
    raw["drafter"]["architecture"] = "dflash2"
    write_yaml(Path(args[0]), raw)
    _launch(*args)
    assert (out / "drafter" / "model.safetensors").is_file()
    exported = json.loads((out / "drafter" / "config.json").read_text())
    assert exported["architectures"] == ["DFlash2DraftModel"]
    rows = _rows(out / "metrics.jsonl")
    assert rows[-1]["step"] >= 2
    assert rows[-1]["val_expected_acceptance"] >= 1  # held-out part of each rank, reduced
    assert rows[-1]["selector_loss"] > 0 and "val_selector_expected_acceptance" in rows[-1]


def test_held_out_prompts_keep_all_their_answers_out_of_training():
    """Several answers per prompt: a held-out prompt's answers never reach training, the held-out
    answer is its first (greedy) one, and the held-out prompts do not depend on answers per
    prompt."""
    one = [Sample(0, i, 10, f"p{i:02d}", 0) for i in range(12)]
    # four answers per prompt, answers of one prompt spread over two shards, answer 0 not first
    four = [
        Sample(a % 2, 4 * i + a, 10, f"p{i:02d}", answer)
        for i in range(12)
        for a, answer in enumerate((2, 0, 3, 1))
    ]
    _, held_one = split_validation(one, 3, seed=5)
    train, held = split_validation(four, 3, seed=5)
    assert sorted(s.prompt for s in held) == sorted(s.prompt for s in held_one)
    assert all(s.answer == 0 for s in held) and len(held) == 3
    assert not {s.prompt for s in train} & {s.prompt for s in held}
    assert len(train) == 4 * 9
    with pytest.raises(DataError, match="would hold out all 12 trainable prompts"):
        split_validation(four, 12, seed=5)


def test_held_out_samples_are_measured_and_never_trained_on(tmp_path, tiny_features):
    samples = [Sample(0, i, 10) for i in range(24)]
    train, held = split_validation(samples, 6, seed=3)
    assert len(held) == 6 and not {(s.row) for s in train} & {s.row for s in held}
    assert split_validation(samples, 6, seed=3) == (train, held)  # same split on every rank/run
    assert split_validation(samples, 0, seed=3) == (samples, [])
    with pytest.raises(DataError, match="val_samples 24 would hold out all 24"):
        split_validation(samples, 24, seed=3)
    args, out = _train(tmp_path, tiny_features, "val", val_samples=6, val_every=2, epochs=1)
    _launch(*args)
    rows = _rows(out / "metrics.jsonl")
    measured = [r for r in rows if "val_loss" in r]
    assert [r["step"] for r in measured] == [
        r["step"] for r in rows if r["step"] % 2 == 0 or r is rows[-1]
    ]
    assert measured and measured[-1]["step"] == rows[-1]["step"]
    for r in measured:
        assert 0 < r["val_loss"] < 100 and len(r["val_slot_accuracy"]) == 7
        assert r["val_expected_acceptance"] >= 1
        # along each block's chain: a slot counts only after every slot before it was right
        assert 1 <= r["val_chain_acceptance"] <= 1 + sum(r["val_slot_accuracy"]) + 1e-9
    assert all(1 <= r["chain_acceptance"] <= 1 + sum(r["slot_accuracy"]) + 1e-3 for r in rows)
    # the held-out pass uses fixed batches: two measurements differ only by training
    assert measured[0]["val_loss"] != measured[-1]["val_loss"] or len(measured) == 1


def test_fsdp_matches_ddp_and_resumes_after_a_kill(tmp_path, tiny_features, monkeypatch):
    """train.parallel: fsdp (FSDP2 fully_shard over 2 gloo processes) follows DDP's loss curve
    and exports the same weights; killed on both ranks mid-run, it resumes on its own curve."""
    from safetensors.torch import load_file

    common = dict(cpu_processes=2, epochs=2, checkpoint_every=2, log_every=1)
    args, ddp = _train(tmp_path, tiny_features, "ddp2", **common)
    _launch(*args)
    args, fsdp = _train(tmp_path, tiny_features, "fsdp", parallel="fsdp", **common)
    _launch(*args)
    a, b = _rows(ddp / "metrics.jsonl"), _rows(fsdp / "metrics.jsonl")
    assert [r["step"] for r in a] == [r["step"] for r in b] and len(a) >= 4
    for x, y in zip(a, b, strict=True):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-3), x["step"]
    wa, wb = (
        load_file(ddp / "drafter" / "model.safetensors"),
        load_file(fsdp / "drafter" / "model.safetensors"),
    )
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wb[k].float(), wa[k].float(), rtol=2e-2, atol=2e-3)
    args, killed = _train(tmp_path, tiny_features, "fsdp-killed", parallel="fsdp", **common)
    monkeypatch.setenv("DFLASHPIPE_KILL_AT", "train.step:3")  # both ranks SIGKILL themselves
    with pytest.raises(Exception):  # noqa: B017 - torchrun reports the dead workers its own way
        _launch(*args)
    monkeypatch.delenv("DFLASHPIPE_KILL_AT")
    assert (killed / "run" / "step-00000002").is_dir() and not (killed / "drafter").exists()
    saved = json.loads((killed / "run" / "step-00000002" / "fingerprint.json").read_text())
    assert saved["train.parallel"] == "fsdp" and saved["world"] == 2  # the sharded path ran
    _launch(*args)
    got = _rows(killed / "metrics.jsonl")
    assert [r["step"] for r in got] == [r["step"] for r in b]
    for x, y in zip(b, got, strict=True):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-4, abs=1e-5), x["step"]


def test_killed_run_resumes_on_the_same_curve(tmp_path, tiny_features):
    """SIGKILL the train job's process group mid-run (Snakemake or a login session killed): the
    launcher and torchrun die, and so do the two workers, though torchrun starts them in
    sessions of their own (none trains on into the run directory); the rerun resumes from the
    last checkpoint on the uninterrupted run's loss curve."""
    import os
    import signal

    common = dict(epochs=6, cpu_processes=2)
    args, out = _train(tmp_path, tiny_features, "whole", **common)
    _launch(*args)
    whole = _rows(out / "metrics.jsonl")
    args, out = _train(tmp_path, tiny_features, "killed", **common)
    cmd = [sys.executable, "-m", "dflashpipe", "train", "--config", args[0], "--manifest", args[1],
           "--run-dir", args[2], "--drafter", args[3], "--metrics", args[4]]  # fmt: skip
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    deadline = time.time() + 120
    while time.time() < deadline and not (out / "run" / "step-00000004").is_dir():
        time.sleep(0.01)
    workers = [p for p in psutil.Process(proc.pid).children(recursive=True)
               if "torch.distributed.run" not in p.cmdline()]  # fmt: skip
    assert len(workers) == 2, workers
    assert {os.getsid(w.pid) for w in workers}.isdisjoint({os.getsid(proc.pid)})
    os.killpg(proc.pid, signal.SIGKILL)  # the launcher and torchrun, not the workers
    proc.wait()
    _, alive = psutil.wait_procs(workers, timeout=30)
    assert not alive, [p.cmdline() for p in alive]
    assert not (out / "drafter" / "model.safetensors").exists(), "killed too late"
    subprocess.run(cmd, check=True, capture_output=True)
    resumed = _rows(out / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [r["step"] for r in whole]
    for a, b in zip(whole, resumed, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-5), a["step"]


def test_manifest_mismatch_is_refused(tmp_path, tiny_features):
    raw = json.loads(json.dumps(tiny_features["raw"]))
    raw["drafter"]["target_layer_ids"] = [1, 0]
    with pytest.raises(DataError, match=r"layer_ids is \[0, 1\], but the consumer needs \[1, 0\]"):
        Trainer(
            Config.from_dict(raw), tiny_features["manifest"], tmp_path / "run", torch.device("cpu")
        )


def _weights(out):
    from safetensors.torch import load_file

    return load_file(out / "drafter" / "model.safetensors")


def _in_process(tmp_path, tiny_features, name, **train):
    """The train stage of one process, here (no interpreter to start): trainer, export, metrics."""
    from dflashpipe.train import run

    raw = json.loads(json.dumps(tiny_features["raw"]))
    raw["train"].update(train)
    out = tmp_path / name
    paths = TrainPaths(Path("unused.yaml"), tiny_features["manifest"], out / "run",
                       out / "drafter", out / "metrics.jsonl")  # fmt: skip
    trainer = run(Config.from_dict(raw), paths, torch.device("cpu"))
    return trainer, out


def test_a_changed_config_trains_afresh_and_sets_the_old_run_aside(tmp_path, tiny_features, caplog):
    """A finished run, then train.lr halved: the rerun does not resume the finished run (it would
    re-export the old drafter); its checkpoints move aside, the log names the key, the new
    drafter differs and its metrics follow the new schedule from step 1. The same for a key of
    another section that train reads (drafter.num_layers)."""
    _, out = _in_process(tmp_path, tiny_features, "lr", max_steps=3, log_every=1)
    before, rows = _weights(out), _rows(out / "metrics.jsonl")
    lr = Config.from_dict(tiny_features["raw"]).train.lr
    _in_process(tmp_path, tiny_features, "lr", max_steps=3, log_every=1, lr=lr / 2)
    after, again = _weights(out), _rows(out / "metrics.jsonl")
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert [r["step"] for r in again] == [r["step"] for r in rows] == [1, 2, 3]
    for old, new in zip(rows, again, strict=True):  # the whole schedule scaled by the new lr
        assert new["lr"] == pytest.approx(old["lr"] / 2, rel=1e-6)
    moved = out / "run.superseded-1"
    assert sorted(p.name for p in moved.glob("step-*")) == sorted(
        p.name for p in (out / "run").glob("step-*")
    )
    raw = json.loads(json.dumps(tiny_features["raw"]))
    raw["train"].update(max_steps=3, log_every=1, lr=lr / 2)
    raw["drafter"]["num_layers"] = 2
    with caplog.at_level("WARNING", logger="dflashpipe.train"):
        trainer = Trainer(Config.from_dict(raw), tiny_features["manifest"], out / "run",
                          torch.device("cpu"))  # fmt: skip
    assert trainer.step == 0 and (out / "run.superseded-2").is_dir()
    assert "drafter.num_layers changed" in caplog.text


def test_resume_safe_keys_resume_and_more_epochs_continue(tmp_path, tiny_features):
    """Changing only log_every resumes the finished run (nothing trained again, same drafter);
    raising epochs continues from its last step; neither sets the run aside."""
    first, out = _in_process(tmp_path, tiny_features, "safe", epochs=1, log_every=2)
    before, rows = _weights(out), _rows(out / "metrics.jsonl")
    assert first.step >= 3 and len(rows) < first.step
    again, _ = _in_process(tmp_path, tiny_features, "safe", epochs=1, log_every=1)
    assert again.step == first.step
    assert all(torch.equal(before[k], v) for k, v in _weights(out).items())
    assert (
        _rows(out / "metrics.jsonl") == rows
    )  # nothing trained again (a fresh run logs each step)
    longer, _ = _in_process(tmp_path, tiny_features, "safe", epochs=2, log_every=1)
    assert longer.step == longer.total_steps > first.step
    assert _rows(out / "metrics.jsonl")[-1]["step"] == longer.step
    assert not list(out.glob("run.superseded-*"))


def test_a_rerun_of_a_finished_run_trains_afresh_and_a_longer_one_resumes(
    tmp_path, tiny_features, caplog
):
    """Issue 60 item 6: a job started over a finished run with the same config was asked to
    train again (`--forcerun train`; Snakemake deleted the outputs first) and trains from step 0,
    the old run set aside; one cut off before its `finished.json` (killed between the final
    checkpoint and the export) resumes; one with only `train.epochs` raised continues."""
    first, out = _in_process(tmp_path, tiny_features, "again", epochs=1, log_every=1)
    run, steps = out / "run", list(range(1, first.step + 1))
    assert json.loads((run / "finished.json").read_text())["step"] == first.step >= 3
    with caplog.at_level("INFO", logger="dflashpipe.train"):
        again, _ = _in_process(tmp_path, tiny_features, "again", epochs=1, log_every=1)
    assert "resumed from" not in caplog.text and "finished with this same" in caplog.text
    moved = out / "run.superseded-1"
    assert (moved / "finished.json").is_file() and checkpoint.latest(moved).name == (
        f"step-{first.step:08d}"
    )
    assert again.step == first.step and [r["step"] for r in _rows(run / "metrics.jsonl")] == steps
    assert (run / "finished.json").is_file()
    (run / "finished.json").unlink()  # cut off after the last checkpoint, before the record
    caplog.clear()
    with caplog.at_level("INFO", logger="dflashpipe.train"):
        _in_process(tmp_path, tiny_features, "again", epochs=1, log_every=1)
    assert "resumed from" in caplog.text and not (out / "run.superseded-2").exists()
    caplog.clear()
    with caplog.at_level("INFO", logger="dflashpipe.train"):
        longer, _ = _in_process(tmp_path, tiny_features, "again", epochs=2, log_every=1)
    assert "resumed from" in caplog.text and not (out / "run.superseded-2").exists()
    assert longer.step == longer.total_steps > first.step
    assert [r["step"] for r in _rows(out / "metrics.jsonl")] == list(range(1, longer.step + 1))
    assert json.loads((run / "finished.json").read_text())["step"] == longer.step


def _rewrite_shards(out, tiny_features, codec: str | None = None, edit=None):
    """tiny_features' shards written again into `out` (another codec, or states changed by
    edit(shard, row, hidden)) with their manifest; returns the manifest's path."""
    import dataclasses

    from dflashpipe.codecs import encode
    from dflashpipe.shards import FeatureShard, build_manifest, feature_row, write_shard
    from dflashpipe.storage import write_json

    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, src in enumerate(tiny_features["shards"]):
        shard = FeatureShard(src)
        info = dataclasses.replace(shard.info, codec=codec or shard.info.codec)
        rows = []
        for k in range(len(shard)):
            r = shard.sample(k)
            if edit is not None:
                edit(i, k, r["hidden"])
            enc = encode(r["hidden"], info.codec, len(info.layer_ids))
            rows.append(
                feature_row(r["sample_id"], r["input_ids"].tolist(), r["loss_mask"].tolist(), enc)
            )
        paths.append(write_shard(out / src.name, rows, info))
    write_json(out / "manifest.json", build_manifest(paths))
    return out / "manifest.json"


def test_fp8_packs_dequantized_on_the_device_train_the_same(tmp_path, tiny_features):
    """On a GPU the trainer keeps fp8 packs as e4m3 bytes + scales and dequantizes them after
    the move (Trainer.quantized): the same weights and held-out figures as decoding them in the
    loader's workers. Here on the CPU, quantized forced on and off."""
    from dflashpipe.data import PackedBatches, epoch_plan

    manifest = _rewrite_shards(tmp_path / "fp8", tiny_features, "fp8-zstd")
    raw = json.loads(json.dumps(tiny_features["raw"]))
    raw["train"].update(max_steps=2, log_every=1, val_samples=4, num_workers=1)
    results = []
    for quantized in (False, True):
        trainer = Trainer(Config.from_dict(raw), manifest, tmp_path / f"run-{quantized}",
                          torch.device("cpu"))  # fmt: skip
        assert trainer.quantized is False  # the CPU default
        trainer.quantized = quantized
        plan = epoch_plan(trainer.samples, trainer.tokens, 0, 0, 0, 1)
        batch = PackedBatches(trainer.shards, trainer.samples, plan, trainer.tokens, 16, 0, 0,
                              quantized=trainer.quantized)[0]  # fmt: skip
        assert ("target_fp8" in batch) is quantized
        trainer.train()
        weights = [p.detach().clone() for p in trainer.drafter.parameters()]
        results.append((trainer.validate(), weights))
    assert results[0][0] == results[1][0]
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1], strict=True))


def test_nan_loss_stops_with_the_samples_and_keeps_the_last_good_checkpoint(
    tmp_path, tiny_features
):
    """A shard whose hidden states hold an inf (extract would have skipped it; here it is
    written by hand) makes the loss non-finite: training stops naming the step and samples."""

    def inf_in_one_sample(shard: int, row: int, hidden: torch.Tensor) -> None:
        if (shard, row) == (1, 3):
            hidden[5] = float("inf")

    _rewrite_shards(tmp_path, tiny_features, edit=inf_in_one_sample)
    raw = json.loads(json.dumps(tiny_features["raw"]))
    raw["train"].update(checkpoint_every=1, log_every=1)
    trainer = Trainer(
        Config.from_dict(raw), tmp_path / "manifest.json", tmp_path / "run", torch.device("cpu")
    )
    with pytest.raises(
        FloatingPointError, match=r"non-finite loss before step \d+.*'shard-00001.arrow', 3\)"
    ):
        trainer.train()
    saved = sorted(p.name for p in (tmp_path / "run").glob("step-*"))
    assert all(
        int(name.split("-")[1]) < trainer.step for name in saved
    )  # nothing saved at or after the NaN


def test_the_first_step_says_where_its_time_went(tmp_path, tiny_features, caplog):
    """Before training's first optimizer step a GPU run compiles for minutes: the trainer logs the
    wait for the first micro-batch, the step and the compile time in it, once."""
    import logging

    from dflashpipe.train import compile_seconds

    raw = json.loads(json.dumps(tiny_features["raw"]))
    raw["train"].update(max_steps=2, log_every=1, val_samples=0, num_workers=0)
    trainer = Trainer(Config.from_dict(raw), tiny_features["manifest"], tmp_path / "run",
                      torch.device("cpu"))  # fmt: skip
    with caplog.at_level(logging.INFO, logger="dflashpipe.train"):
        trainer.train()
    said = [r.getMessage() for r in caplog.records if "first optimizer step" in r.getMessage()]
    assert len(said) == 1 and trainer.step == 2
    total, waited, took, compiling = map(float, re.findall(r"(\d+\.\d) s", said[0]))
    assert total == pytest.approx(waited + took, abs=0.11) and compiling <= took + 0.05
    # the compile time is Dynamo's own account, forward and backward graphs included
    before = compile_seconds()
    x = torch.randn(8, requires_grad=True)
    torch.compile(lambda t: torch.sin(t) * 2 + t, dynamic=False)(x).sum().backward()
    assert compile_seconds() > before


def test_answers_per_prompt_trains_on_each_prompts_first_answers(tmp_path, tiny_features):
    """Features of two answers per prompt (the fixture's as answer 0, each again as answer 1 in
    two more shards): train.answers_per_prompt 1 trains on answer 0 of every training prompt, 2
    on both, with the same held-out samples and the tokens trained on counted (the metrics rows
    carry them: test_quality); 3 is refused, naming the manifest."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dflashpipe.extract import ExtractPaths
    from dflashpipe.extract import run as extract
    from dflashpipe.shards import build_manifest
    from dflashpipe.storage import write_json

    raw = json.loads(json.dumps(tiny_features["raw"]))
    cfg = Config.from_dict(raw)
    shards = list(tiny_features["shards"])
    for i in range(2):
        seq = pq.read_table(tiny_features["dir"] / f"seq-{i}.parquet")
        ids = [s.rpartition("-")[0] + "-1" for s in seq.column("sample_id").to_pylist()]
        seq = seq.set_column(seq.schema.get_field_index("sample_id"), "sample_id", pa.array(ids))
        pq.write_table(seq, tmp_path / f"seq-{i}.parquet")
        shards.append(tmp_path / f"shard-{i + 2:05d}.arrow")
        extract(cfg, ExtractPaths(str(tmp_path / f"seq-{i}.parquet"), i + 2, str(shards[-1])))
    manifest = tmp_path / "manifest.json"
    write_json(manifest, build_manifest(shards))
    raw["train"].update(val_samples=4)
    trainers = {}
    for n in (None, 1, 2):
        raw["train"].update(answers_per_prompt=n)
        trainers[n] = Trainer(Config.from_dict(raw), manifest, tmp_path / f"t{n}",
                              torch.device("cpu"))  # fmt: skip
    every, one, two = trainers[None], trainers[1], trainers[2]
    assert len(every.samples) == 2 * 20 and {s.answer for s in every.samples} == {0, 1}
    assert [s.answer for s in one.samples] == [0] * 20
    assert sorted(s.prompt for s in one.samples) == sorted({s.prompt for s in every.samples})
    assert two.samples == every.samples
    assert one.val_samples == two.val_samples == every.val_samples
    assert one.train_tokens == sum(s.length for s in one.samples) < two.train_tokens
    assert (
        one.fingerprint["train.answers_per_prompt"] == 1
        and every.fingerprint["train.answers_per_prompt"] is None
    )
    raw["train"].update(answers_per_prompt=3)
    with pytest.raises(
        DataError,
        match=r"answers_per_prompt is 3, but the features of .*"
        r"manifest\.json hold at most 2 answers per prompt",
    ):
        Trainer(Config.from_dict(raw), manifest, tmp_path / "t3", torch.device("cpu"))
    raw["train"].update(answers_per_prompt=0)
    with pytest.raises(ConfigError, match="answers_per_prompt"):
        Config.from_dict(raw)


def test_dropout_and_weight_decay_regularize_training_only(tmp_path, tiny_features):
    """train.dropout 0.5: two training forwards of one pack differ, the held-out measurement
    (eval mode) repeats exactly and leaves the model training; train.weight_decay 0.1: a step
    with zero gradients shrinks the matrices by lr x decay and leaves the norms' gains alone;
    both are other runs' checkpoints (fingerprint)."""
    from dflashpipe.data import PackedBatches, epoch_plan
    from dflashpipe.objective import forward_loss

    raw = json.loads(json.dumps(tiny_features["raw"]))
    raw["train"].update(dropout=0.5, weight_decay=0.1, val_samples=4, lr=0.01, warmup_ratio=0)
    t = Trainer(Config.from_dict(raw), tiny_features["manifest"], tmp_path / "t",
                torch.device("cpu"))  # fmt: skip
    assert (t.fingerprint["train.dropout"], t.fingerprint["train.weight_decay"]) == (0.5, 0.1)
    plan = epoch_plan(t.samples, t.tokens, 0, 0, 0, 1)
    batch = PackedBatches(t.shards, t.samples, plan, t.tokens, 16, 0, 0)[0]
    with torch.no_grad():
        a, b = (forward_loss(t.model, t.head, batch, 8, t.gamma)[0].item() for _ in range(2))
    assert a != b  # dropout drew other units
    first, second = t.validate(), t.validate()
    assert first == second and t.model.training
    t.model.eval()
    with torch.no_grad():
        a, b = (forward_loss(t.model, t.head, batch, 8, t.gamma)[0].item() for _ in range(2))
    assert a == b
    before = {n: p.detach().clone() for n, p in t.drafter.named_parameters() if p.requires_grad}
    for p in t.drafter.parameters():
        p.grad = torch.zeros_like(p) if p.requires_grad else None
    t.optimizer.step()
    lr = t.optimizer.param_groups[0]["lr"]
    for name, p in t.drafter.named_parameters():
        if name in before:
            shrink = 1 - lr * 0.1 if p.ndim >= 2 else 1.0
            torch.testing.assert_close(p.detach(), before[name] * shrink, msg=name)
    assert any("norm" in n for n in before) and any(p.ndim < 2 for p in t.drafter.parameters())
    raw["train"].update(dropout=1.0)
    with pytest.raises(ConfigError, match="dropout"):
        Config.from_dict(raw)


def test_drafter_sliding_window_is_trained_and_exported(tmp_path, tiny_features):
    """drafter.sliding_window from the config: the drafter trains with it on every layer but the
    last and the export tells serving engines so."""
    raw = json.loads(json.dumps(tiny_features["raw"]))
    raw["drafter"].update(num_layers=2, sliding_window=16)
    raw["train"].update(max_steps=2)
    config = write_yaml(tmp_path / "window.yaml", raw)
    out = tmp_path / "window"
    _launch(str(config), str(tiny_features["manifest"]), str(out / "run"), str(out / "drafter"),
           str(out / "metrics.jsonl"))  # fmt: skip
    cfg = json.loads((out / "drafter" / "config.json").read_text())
    assert cfg["layer_types"] == ["sliding_attention", "full_attention"]
    assert (cfg["sliding_window"], cfg["use_sliding_window"]) == (16, True)


# Issue 63: a DFlash2 drafter trains on the unary loss plus the selector's, reports the
# selector's figures beside the unary ones, and exports what the official package loads.
SELECTOR_KEYS = ("unary_accuracy", "top_k_recall", "selector_accuracy", "selector_slot_accuracy",
                 "selector_expected_acceptance", "selector_chain_acceptance", "unary_loss",
                 "selector_loss")  # fmt: skip


def test_dflash2_trains_reports_its_selector_and_exports_for_the_official_loader(
    tmp_path, tiny_features, caplog
):
    """drafter.architecture dflash2 (top 4, rank 8) with train.selector's warm-up and ramp: the
    loss falls, every metrics row and held-out row carries the selector's figures, the export
    loads in dflash==0.1.0 taking every tensor; weight decay spares the base kernels; a resume
    across architectures is refused naming the weights, and an architecture edit trains afresh."""
    from test_official import load_official

    from dflashpipe.model import Drafter
    from dflashpipe.train import check_resumed_keys, decay_groups, run

    raw = json.loads(json.dumps(tiny_features["raw"]))
    raw["drafter"].update(architecture="dflash2", selector_top_k=4, selector_rank=8)
    raw["train"].update(max_steps=10, log_every=2, val_samples=4, val_every=5, weight_decay=0.01,
                        selector={"warmup_steps": 2, "ramp_steps": 2,
                                  "outside_top_k": "replace"})  # fmt: skip
    out = tmp_path / "d2"
    paths = TrainPaths(Path("unused.yaml"), tiny_features["manifest"], out / "run",
                       out / "drafter", out / "metrics.jsonl")  # fmt: skip
    trainer = run(Config.from_dict(raw), paths, torch.device("cpu"))
    assert [trainer.selector.alpha_at(s) for s in range(5)] == [0, 0, 0.5, 1, 1]
    rows = _rows(out / "metrics.jsonl")
    assert rows[-1]["unary_loss"] < rows[0]["unary_loss"] == rows[0]["loss"]  # alpha 0 at first
    assert rows[-1]["selector_loss"] < rows[0]["selector_loss"]
    assert rows[-1]["loss"] == pytest.approx(rows[-1]["unary_loss"] + rows[-1]["selector_loss"])
    for row in rows:
        assert all(k in row for k in SELECTOR_KEYS), row
        assert len(row["selector_slot_accuracy"]) == 7 and row["selector_expected_acceptance"] >= 1
        assert 0 <= row["selector_accuracy"] <= row["top_k_recall"] <= 1
    measured = [r for r in rows if "val_loss" in r]
    assert [r["step"] for r in measured] == [5, 10]
    assert all(f"val_{k}" in r for r in measured for k in SELECTOR_KEYS)
    cfg = json.loads((out / "drafter" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"]
    assert cfg["dflash_config"]["selector_top_k"] == 4
    load_official(out / "drafter", "dflash2")
    groups = decay_groups(trainer.drafter)
    kernels = [p for n, p in trainer.drafter.named_parameters() if n.endswith(".base_kernel")]
    assert kernels and all(any(p is k for p in groups[1]["params"]) for k in kernels)
    assert groups[1]["weight_decay"] == 0.0
    codebook = trainer.drafter.candidate_selector.successor_codebook
    assert any(p is codebook for p in groups[0]["params"])
    # a checkpoint of one architecture into a drafter of the other, either way: refused
    state = trainer.drafter.trainable_state_dict()
    d = trainer.drafter
    dflash = Drafter(dataclasses.replace(trainer.dcfg, architecture="dflash"),
                     d.embed_tokens.weight, d.lm_head.weight)  # fmt: skip
    with pytest.raises(DataError, match=r"does not \[.*'layers.0.attention_conv.base_kernel'"):
        check_resumed_keys(dflash.load_state_dict(state, strict=False), out / "ckpt")
    with pytest.raises(DataError, match=r"it lacks \[.*'candidate_selector.predecessor_codebook'"):
        check_resumed_keys(d.load_state_dict(dflash.trainable_state_dict(), strict=False), "x")
    raw["drafter"] = tiny_features["raw"]["drafter"]
    raw["train"].pop("selector")
    with caplog.at_level("WARNING", logger="dflashpipe.train"):
        again = Trainer(Config.from_dict(raw), tiny_features["manifest"], out / "run",
                        torch.device("cpu"))  # fmt: skip
    assert again.step == 0 and "drafter.architecture, " in caplog.text


# Issue 62: train.loss's objectives, D-PACE weights and greedy labels, and the target's whole
# distribution from the final hidden states extract stores (extract.final_hidden).


@pytest.fixture(scope="module")
def final_features(tiny_features, tmp_path_factory) -> dict:
    """tiny_features' sequences extracted again with the target's final hidden states
    (extract.final_hidden)."""
    from conftest import reextracted

    return reextracted(tiny_features, tmp_path_factory, "final-features", final_hidden=True)


def _first_batch(trainer: Trainer) -> dict:
    from dflashpipe.data import PackedBatches, epoch_plan, to_device

    plan = epoch_plan(trainer.samples, trainer.tokens, 0, 0, 0, 1)
    batch = PackedBatches(trainer.shards, trainer.samples, plan, trainer.tokens, 16, 0, 0,
                          trainer.topk)[0]  # fmt: skip
    return to_device(batch, torch.device("cpu"), trainer.final_width)


def test_default_loss_is_the_old_decay_cross_entropy(tmp_path, tiny_features, final_features):
    """Unset train.loss (and its keys at their defaults): the loss of a batch is bit for bit the
    call made before issue 62 (dflash_loss's decay cross-entropy with no new keyword), and equals
    a float64 decay-weighted cross-entropy; features that also hold the final hidden states
    train the same drafter inputs (the final block is split off before fc)."""
    from dflashpipe.loss import block_labels, dflash_loss
    from dflashpipe.objective import forward_loss

    cfg = Config.from_dict(tiny_features["raw"])
    assert cfg.train.loss.objective == "cross_entropy" and "loss" not in cfg.raw["train"]
    t = Trainer(cfg, tiny_features["manifest"], tmp_path / "a", torch.device("cpu"))
    b = _first_batch(t)
    with torch.no_grad():
        new, metrics = forward_loss(t.model, t.head, b, 8, t.gamma, loss=cfg.train.loss)
        out = t.model(b["input_ids"], b["target_hidden"], b["position_ids"], b["document_ids"],
                      b["anchors"], b["keep"])  # fmt: skip
        labels, valid = block_labels(b["input_ids"], b["document_ids"], b["loss_mask"],
                                     b["anchors"], b["keep"], 8)  # fmt: skip
        old, _ = dflash_loss(out, t.head, labels, valid, t.gamma)
    assert torch.equal(new, old)
    logp = (out.double() @ t.head.double().T).log_softmax(-1)  # (A, B, V)
    ce = -logp.gather(2, labels[..., None])[..., 0]
    w = torch.exp(-(torch.arange(8) - 1) / t.gamma).double() * valid
    assert new.item() == pytest.approx(((w * ce).sum() / w.sum()).item(), rel=1e-5)

    raw = json.loads(json.dumps(final_features["raw"]))
    both = Trainer(Config.from_dict(raw), final_features["manifest"], tmp_path / "b",
                   torch.device("cpu"))  # fmt: skip
    fb = _first_batch(both)
    assert both.final_width == 64 and fb["target_final"].shape == (both.tokens, 64)
    assert torch.equal(fb["target_hidden"], b["target_hidden"])  # same taps, same bytes
    both.drafter.load_state_dict(t.drafter.state_dict())
    with torch.no_grad():
        same, _ = forward_loss(both.model, both.head, fb, 8, both.gamma, loss=both.tc.loss)
    assert torch.equal(same, new)


# train.loss, the features trained on, and the target's distribution read from them (None: the
# loss needs none)
CELLS = {
    "dpace": ({"weighting": "dpace", "dpace_mix": 0.25}, "final", None),
    "forward_kl": ({"objective": "forward_kl", "kl_temperature": 2.0}, "final", "final"),
    "forward_kl_topk": ({"objective": "forward_kl", "weighting": "dpace"}, "topk", "topk"),
    "expected_length": ({"objective": "expected_length"}, "final", None),
    "greedy": ({"labels": "greedy"}, "final", "final"),
}


@pytest.mark.parametrize("cell", list(CELLS))
def test_each_objective_trains_and_its_loss_falls(
    cell, tmp_path, final_features, tiny_topk_features
):
    """Each train.loss choice trains in the stage's own process for 12 steps: every logged loss
    is finite and the last ones are below the first (expected length: more negative)."""
    loss, made, source = CELLS[cell]
    features = final_features if made == "final" else tiny_topk_features
    raw = json.loads(json.dumps(features["raw"]))
    raw["train"].update(loss=loss, max_steps=12, log_every=2, lr=3e-3)
    cfg = Config.from_dict(raw)
    trainer = Trainer(cfg, features["manifest"], tmp_path / "run", torch.device("cpu"))
    assert trainer.source.final == (source == "final") and bool(trainer.topk) == (source == "topk")
    trainer.train()
    losses = [r["loss"] for r in _rows(tmp_path / "run" / "metrics.jsonl")]
    assert len(losses) == 6 and all(math.isfinite(x) for x in losses), losses
    assert sum(losses[-2:]) < sum(losses[:2]), losses


def test_greedy_labels_follow_the_targets_argmax_from_either_source(
    tmp_path, final_features, tiny_topk_features
):
    """labels greedy on a real batch: each kept slot is labelled with the target's argmax (its
    top-1 from extract.topk, or its head over the stored final hidden states: the same tokens
    but for near-ties moved by the states' bf16 rounding), every block keeps a prefix of its
    valid slots that ends at its first label that leaves the answer, and slots after it drop."""
    from dflashpipe.loss import block_labels, block_soft_targets, greedy_labels, target_argmax

    def greedy(features):
        raw = json.loads(json.dumps(features["raw"]))
        raw["train"]["loss"] = {"labels": "greedy"}
        t = Trainer(
            Config.from_dict(raw), features["manifest"], tmp_path / "g", torch.device("cpu")
        )
        b = _first_batch(t)
        labels, valid = block_labels(b["input_ids"], b["document_ids"], b["loss_mask"],
                                     b["anchors"], b["keep"], 8)  # fmt: skip
        if t.source.final:
            from dflashpipe.loss import block_target_hidden

            top = target_argmax(block_target_hidden(b["target_final"], b["anchors"], 8), t.head)
        else:
            top = block_soft_targets(b["topk_ids"], b["topk_logprobs"], b["anchors"], 8)[0][..., 0]
        return labels, valid, top.long(), greedy_labels(labels, valid, top[..., None])

    labels, valid, top, (got, keep) = greedy(tiny_topk_features)
    assert keep.sum() < valid.sum()  # a random target parts from the answers: slots drop
    for a in range(len(labels)):
        slots = valid[a].nonzero()[:, 0].tolist()
        parts = [j for j in slots if top[a, j] != labels[a, j]]
        want = [j for j in slots if not parts or j <= parts[0]]
        assert keep[a].nonzero()[:, 0].tolist() == want
        assert all(got[a, j] == top[a, j] for j in want)
    _, _, top_final, (got_final, keep_final) = greedy(final_features)
    agree = (top_final == top)[valid].float().mean()
    assert agree > 0.95, agree


def test_greedy_labels_read_the_stored_top_1_where_the_final_state_is_stored_too(
    tmp_path, tiny_features, tmp_path_factory
):
    """Features with both the final hidden state and the top-1: greedy labels come from the
    top-1 (the target's own argmax at extract; a quantized final state's argmax moves on some
    positions: benchmarks/final_hidden_codec.py). With the stored top-1 moved to another token,
    the greedy cross-entropy follows it: equal to the one read from the top-1 alone, unlike the
    one read from the final state alone."""
    from conftest import reextracted

    from dflashpipe.objective import forward_loss

    features = reextracted(tiny_features, tmp_path_factory, "final-top1",
                           final_hidden=True, topk=1)  # fmt: skip
    raw = json.loads(json.dumps(features["raw"]))
    raw["train"]["loss"] = {"labels": "greedy"}
    t = Trainer(Config.from_dict(raw), features["manifest"], tmp_path / "g", torch.device("cpu"))
    assert t.source.final and t.topk == 1 and "top-1" in t.source.describe()
    b = _first_batch(t)
    b["topk_ids"] = (b["topk_ids"] + 1) % t.head.shape[0]  # another token than the target's argmax
    only_top1 = {k: v for k, v in b.items() if k != "target_final"}
    only_final = {k: v for k, v in b.items() if k not in ("topk_ids", "topk_logprobs")}
    both, top1, final = (forward_loss(t.model, t.head, x, 8, 4.0, loss=t.tc.loss)[0].item()
                         for x in (b, only_top1, only_final))  # fmt: skip
    assert both == top1 and both != final
