"""What each stage reads (src/dflashpipe/stages.py) and what an edit reruns: the key-change matrix
over every leaf of the schema, the resume fingerprint, and real `snakemake -n` dry runs of a
finished workflow copied (checkout and results) to another folder."""

import itertools
import json
import re
import shutil

import pytest
import yaml
from conftest import REPO, SNAKEMAKE

from dflashpipe import stages
from dflashpipe.config import Config, _schema
from dflashpipe.errors import ConfigError
from dflashpipe.preflight import check_config

# Valid other values where the schema alone does not give one (null defaults, free strings,
# lists, keys whose change needs another key to stay valid).
OTHER = {
    "target.model": "another/model",
    "target.gguf_file": "other.gguf",
    "target.tokenizer": "another/tokenizer",
    "target.revision": "main",
    "target.attn_implementation": "eager",
    "target.chat_template": "none",
    "evaluate.concurrency": [1, 4],
    "retrieve": {},
    "prompts.sources": [{"name": "x", "kind": "jsonl", "path": "x.jsonl"}],
    "prompts.exclude": ["other/train.parquet"],
    "prompts.trim_history": True,
    "regenerate.samples_per_prompt": {
        "regenerate.samples_per_prompt": 2,
        "regenerate.temperature": 0.7,
    },  # fmt: skip
    "regenerate.enable_thinking": False,
    "regenerate.max_prompt_tokens": 100,
    "extract.encode_workers": 3,
    # a group size only with the codec that has groups
    "extract.group_size": {"extract.codec": "fp4-zstd", "extract.group_size": 16},
    "extract.final_hidden": True,
    "drafter.target_layer_ids": [0, 1],
    "drafter.mask_token_id": 5,
    "drafter.sliding_window": {"drafter.sliding_window": 64, "drafter.num_layers": 2},
    "train.betas": [0.9, 0.999],
    "train.extra_features": ["other/manifest.json"],
    "train.micro_batch_tokens": 1024,
    "train.tokens_per_step": 4096,
    "train.max_steps": 10,
    "train.gamma": 5.0,
    "train.answers_per_prompt": 1,
    # train.loss has no default (unset stays out of train's digest): each key set to a value
    # other than its own default, with the partner keys it needs to stay valid
    "train.loss.objective": {"train.loss.objective": "expected_length"},
    "train.loss.weighting": {"train.loss.weighting": "dpace"},
    "train.loss.dpace_mix": {"train.loss.weighting": "dpace", "train.loss.dpace_mix": 0.25},
    "train.loss.length_share": {
        "train.loss.objective": "expected_length",
        "train.loss.length_share": 1.0,
    },  # fmt: skip
    "train.loss.kl_temperature": {
        "train.loss.objective": "forward_kl",
        "train.loss.kl_temperature": 2.0,
        "extract.final_hidden": True,
    },  # fmt: skip
    "train.loss.labels": {"train.loss.labels": "greedy", "extract.topk": 4},
    # issue 63: no schema default for the architecture, its sizes and train.selector (unset
    # they stay out of train's digest); the sizes and the selector only on a dflash2 drafter
    "drafter.architecture": "dflash2",
    **{
        f"drafter.{k}": {"drafter.architecture": "dflash2", f"drafter.{k}": v}
        for k, v in (
            ("conv_kernel_size", 3),
            ("conv_group_size", 8),
            ("selector_rank", 32),
            ("selector_top_k", 8),
        )
    },
    **{
        f"train.selector.{k}": {"drafter.architecture": "dflash2", f"train.selector.{k}": v}
        for k, v in (
            ("alpha", 0.5),
            ("warmup_steps", 100),
            ("ramp_steps", 100),
            ("stop_gradient", True),
            ("outside_top_k", "replace"),
        )
    },
    "evaluate.methods": ["target", "dflash"],
    "evaluate.tree_nodes": [8],
    "evaluate.selector": {"drafter.architecture": "dflash2", "evaluate.selector": False},
    "devices.extract": [0],
    "devices.train": [1],
}

DOWN_FROM = {
    "regenerate": {"regenerate", "extract", "train", "evaluate", "report"},
    "extract": {"extract", "train", "evaluate", "report"},
    "train": {"train", "evaluate", "report"},
    "evaluate": {"evaluate", "report"},
}
# The keys that matter, by hand: an edit to the left reruns exactly these stages.
EXPECTED = {
    "extract.codec": DOWN_FROM["extract"],
    "extract.topk": DOWN_FROM["extract"],
    "extract.group_size": DOWN_FROM["extract"],
    "extract.final_hidden": DOWN_FROM["extract"],
    "extract.max_length": DOWN_FROM["regenerate"],  # the answers' room
    "extract.encode_workers": set(),
    "extract.direct_io": set(),
    "drafter.block_size": DOWN_FROM["train"],
    "drafter.num_layers": DOWN_FROM["train"],
    "drafter.target_layer_ids": DOWN_FROM["extract"],
    "drafter.num_target_layers": DOWN_FROM["extract"],
    "train.lr": DOWN_FROM["train"],
    "train.epochs": DOWN_FROM["train"],
    "train.seed": DOWN_FROM["train"],
    "train.loss.objective": DOWN_FROM["train"],
    "train.loss.weighting": DOWN_FROM["train"],
    "train.loss.dpace_mix": DOWN_FROM["train"],
    "train.loss.length_share": DOWN_FROM["train"],
    "drafter.architecture": DOWN_FROM["train"],
    "drafter.conv_group_size": DOWN_FROM["train"],
    "drafter.selector_top_k": DOWN_FROM["train"],
    "train.selector.alpha": DOWN_FROM["train"],
    "train.selector.outside_top_k": DOWN_FROM["train"],
    "devices.extract": set(),
    "devices.train": set(),
    "prompts.max_train": {"prompts", *DOWN_FROM["regenerate"]},
}
EXPECTED |= {f"regenerate.{k}": DOWN_FROM["regenerate"]
             for k in _schema()["properties"]["regenerate"]["properties"]}  # fmt: skip
EXPECTED |= {f"evaluate.{k}": DOWN_FROM["evaluate"]
             for k in _schema()["properties"]["evaluate"]["properties"]}  # fmt: skip
# its partner (drafter.architecture dflash2) retrains; alone on a dflash2 run it reruns evaluate
# (test_evaluate_selector_alone_reruns_evaluate)
EXPECTED["evaluate.selector"] = DOWN_FROM["train"]


def _leaf_schema(key):
    node = _schema()
    for part in key.split("."):
        node = node["properties"][part]
    return node


def _other(key, current):
    """A valid value other than `current` for `key` ({key: value, ...} where a partner key must
    change with it)."""
    if key in OTHER:
        return (
            OTHER[key] if isinstance(OTHER[key], dict) and key != "retrieve" else {key: OTHER[key]}
        )
    s = _leaf_schema(key)
    if "enum" in s:
        return {key: next(v for v in s["enum"] if v != current)}
    kinds = s.get("type")
    kinds = kinds if isinstance(kinds, list) else [kinds]
    if "boolean" in kinds:
        return {key: not current}
    if "integer" in kinds:
        value = (current or s.get("minimum", 0)) + 1
        return {key: value if value <= s.get("maximum", value) else current - 1}
    if "number" in kinds:
        return {key: current / 2 if current else 0.5}
    raise AssertionError(f"no other value known for {key} (add it to OTHER)")


def _edited(raw, change):
    out = json.loads(json.dumps(raw))
    for key, value in change.items():
        node = out
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


@pytest.fixture(scope="module")
def base():
    return Config.from_dict(yaml.safe_load((REPO / "config.yaml").read_text()))


def test_every_leaf_is_described_and_read_by_a_stage():
    leaves = stages.schema_leaves()
    assert "extract.codec" in leaves and "prompts.sources" in leaves and "retrieve" in leaves
    undescribed = [k for k in leaves if not _leaf_schema(k).get("description")]
    assert not undescribed, f"schema keys without a description: {undescribed}"
    read = {k for name in stages.STAGES for k in stages.reads(name)}
    assert not [k for k in leaves if k not in read], "keys no stage reads: a key that does nothing"
    with pytest.raises(KeyError, match="'extract.codecs', which is no key"):
        stages.expand(("extract.codecs",))


def test_key_change_matrix(base):
    """Every leaf changed to a valid other value: the stages whose digest changes, and what lies
    downstream of them, are exactly what the declarations say, and for the keys that matter what
    the table above says. A digest that ignored a key, or covered a whole section, fails here."""
    for key in stages.schema_leaves():
        change = _other(key, stages.value(base.raw, key))
        try:
            edited = Config.from_dict(_edited(base.raw, change))
            check_config(edited)
        except ConfigError as e:
            raise AssertionError(f"{key}: the other value {change} is not valid: {e}") from None
        direct = {s for s in stages.STAGES if stages.digest(base, s) != stages.digest(edited, s)}
        declared = set().union(*(stages.readers(k) for k in change))
        assert direct == declared, (key, direct, declared)
        reruns = stages.downstream(direct)
        if key in EXPECTED:
            assert reruns == EXPECTED[key], (key, sorted(reruns), sorted(EXPECTED[key]))


def test_evaluate_selector_alone_reruns_evaluate(base):
    """On a DFlash2 run, evaluate.selector unset, true and false: true decodes as unset does but
    enters the digest once written; each edit reruns evaluate (and the report) only."""
    dflash2 = {"drafter.architecture": "dflash2"}
    runs = [Config.from_dict(_edited(base.raw, dflash2 | t))
            for t in ({}, {"evaluate.selector": True}, {"evaluate.selector": False})]  # fmt: skip
    for a, b in itertools.combinations(runs, 2):
        direct = {s for s in stages.STAGES if stages.digest(a, s) != stages.digest(b, s)}
        assert direct == {"evaluate"} and stages.downstream(direct) == DOWN_FROM["evaluate"]


def test_a_group_size_edit_reruns_extract_and_nothing_upstream(base):
    """The matrix changes the codec with the group size; here only the group size moves."""
    fp4 = {"extract.codec": "fp4-zstd"}
    runs = [Config.from_dict(_edited(base.raw, fp4 | {"extract.group_size": g}))
            for g in (None, 16, 64)]  # fmt: skip
    for a, b in itertools.combinations(runs, 2):
        direct = {s for s in stages.STAGES if stages.digest(a, s) != stages.digest(b, s)}
        assert direct == {"extract"}


def test_unset_loss_and_final_hidden_keep_finished_runs_current(base):
    """Issue 62's keys have no schema default at their top (train.loss, extract.final_hidden):
    unset, they stay out of every digest, so a run finished before they existed stays current;
    the section set, its keys' defaults enter train's digest and resume fingerprint."""
    assert "loss" not in base.raw["train"] and "final_hidden" not in base.raw["extract"]
    assert base.train.loss.objective == "cross_entropy" and not base.extract.final_hidden
    explicit = Config.from_dict(_edited(base.raw, {"train.loss": {}}))
    assert explicit.raw["train"]["loss"] == {"objective": "cross_entropy", "weighting": "decay",
                                             "dpace_mix": 0.5, "length_share": 0.5,
                                             "kl_temperature": 1.0,
                                             "labels": "sampled"}  # fmt: skip
    changed = {s for s in stages.STAGES if stages.digest(base, s) != stages.digest(explicit, s)}
    assert changed == {"train"}
    off = Config.from_dict(_edited(base.raw, {"extract.final_hidden": False}))
    assert {s for s in stages.STAGES if stages.digest(base, s) != stages.digest(off, s)} == {
        "extract"
    }


def test_unset_architecture_and_selector_keep_finished_runs_current(base):
    """Issue 63's keys have no schema default (drafter.architecture, its four sizes,
    train.selector): a default config's digests are those of a config without them, so no
    finished run retrains; dflash2 with the selector unset takes SelectorConfig's defaults."""
    drafter, train = base.raw["drafter"], base.raw["train"]
    assert not {"architecture", "conv_group_size", "selector_top_k"} & set(drafter)
    assert "selector" not in train and base.drafter.architecture == "dflash"
    d2 = Config.from_dict(_edited(base.raw, {"drafter.architecture": "dflash2"}))
    assert {s for s in stages.STAGES if stages.digest(base, s) != stages.digest(d2, s)} == {"train"}
    assert d2.train.selector is None and d2.drafter.model_fields() == {"architecture": "dflash2"}


def test_resume_fingerprint_covers_what_train_reads_but_the_safe_keys():
    keys = set(stages.fingerprint_keys("train"))
    for key in ("train.lr", "train.betas", "train.seed", "train.warmup_ratio", "train.grad_clip",
                "train.gamma", "train.num_anchors", "drafter.block_size", "target.model",
                *(f"train.loss.{k}" for k in ("objective", "weighting", "dpace_mix",
                                              "length_share", "kl_temperature", "labels")),
                "drafter.architecture", "drafter.conv_kernel_size", "drafter.conv_group_size",
                "drafter.selector_rank", "drafter.selector_top_k",
                *(f"train.selector.{k}" for k in ("alpha", "warmup_steps", "ramp_steps",
                                                  "stop_gradient", "outside_top_k"))):  # fmt: skip
        assert key in keys, key
    for key in ("train.epochs", "train.max_steps", "train.log_every", "train.checkpoint_every",
                "train.keep_checkpoints", "devices.train", "extract.codec"):  # fmt: skip
        assert key not in keys, key


def _planned(work, snakefile, config):
    """The rules a dry run would run (Snakemake's job table), {} when nothing is to be done."""
    import subprocess

    cmd = [*SNAKEMAKE[:-2], "--snakefile", str(snakefile), "--directory", str(work), "-n",
           "--configfile", str(config)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    if "Nothing to be done" in out:
        return set()
    table = out[out.index("Job stats:") :].split("\n\n")[0]
    return {m.group(1) for m in re.finditer(r"^(\w+)\s+\d+$", table, re.M)} - {"total", "all"}


@pytest.mark.slow
def test_a_copied_run_plans_nothing_and_an_edit_plans_what_it_changes(default_workflow, tmp_path):
    """The finished default run and the checkout it ran from, both copied elsewhere: the copy
    plans no job. Then edits in the copy plan exactly their stages: extract.codec no regenerate,
    drafter.block_size no extract, train.lr train on."""
    copy = tmp_path / "moved"
    shutil.copytree(default_workflow, copy / "run", symlinks=True)
    for part in ("Snakefile", "workflow", "src"):
        (shutil.copytree if (REPO / part).is_dir() else shutil.copy2)(REPO / part, copy / part)
    snakefile, work = copy / "Snakefile", copy / "run"
    raw = yaml.safe_load((work / "small.yaml").read_text())
    assert _planned(work, snakefile, work / "small.yaml") == set()
    cases = {
        "extract.codec": (
            "fp8-zstd",
            {"extract_shard", "extract_manifest", "train", "evaluate", "report"},
        ),  # fmt: skip
        "drafter.block_size": (8, {"train", "evaluate", "report"}),
        "train.lr": (3.0e-4, {"train", "evaluate", "report"}),
        "devices.extract": ([0], set()),
    }
    for key, (value, want) in cases.items():
        edited = work / f"{key}.yaml"
        edited.write_text(yaml.safe_dump(_edited(raw, {key: value})))
        assert _planned(work, snakefile, edited) == want, key


def test_readme_rerun_table_is_the_declarations():
    text = (REPO / "README.md").read_text()
    start = text.index("<!-- rerun-table")
    block = text[text.index("-->", start) + 3 : text.index("<!-- /rerun-table -->")]
    assert block.strip() == stages.rerun_table(), (
        "README's rerun table: regenerate it from stages.rerun_table()"
    )
