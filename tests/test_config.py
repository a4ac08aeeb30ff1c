import subprocess
import sys

import pytest
import yaml
from conftest import REPO, base_config, write_yaml

from dflashpipe.config import Config, load_config
from dflashpipe.errors import ConfigError

SHIPPED = [REPO / "config.yaml", *sorted((REPO / "configs").glob("*.yaml"))]
ON_TOP = "# on top of: "  # an overlay recipe's first line: the recipe it is merged onto


def shipped(path):
    """A shipped config as Snakemake reads it: an overlay recipe (first line `# on top of:
    BASE`) merged onto its base, as `--configfile BASE OVERLAY` merges them."""
    first = path.read_text().splitlines()[0]
    if not first.startswith(ON_TOP):
        return load_config(path)
    from snakemake.utils import update_config  # Snakemake's own merge of --configfile files

    raw = yaml.safe_load((REPO / first.removeprefix(ON_TOP).strip()).read_text())
    update_config(raw, yaml.safe_load(path.read_text()))
    return Config.from_dict(raw)


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_configs_validate(path):
    cfg = shipped(path)
    assert cfg.prompts.sources, path
    assert cfg.raw["train"]["lr"] > 0  # defaults are filled in


def test_the_x4_recipe_is_the_measured_cell():
    """configs/smollm2-sharegpt-x4.yaml regenerates in one run what the quality cell `x4` joined
    from three runs (benchmarks/quality/x4.yaml, its sampled halves, the fp4 codec): the same
    sampling, codec and epochs, four answers per prompt with the greedy one first."""
    x4 = shipped(REPO / "configs" / "smollm2-sharegpt-x4.yaml").raw
    cells = {
        name: yaml.safe_load((REPO / "benchmarks" / "quality" / f"{name}.yaml").read_text())
        for name in ("x4", "x4-sampled-b", "sampled-answers", "fp4")
    }
    sampled = cells["x4-sampled-b"]["regenerate"]
    assert (x4["regenerate"]["temperature"], x4["regenerate"]["top_p"]) == (
        sampled["temperature"],
        sampled["top_p"],
    )
    assert cells["sampled-answers"]["regenerate"]["temperature"] == sampled["temperature"]
    answers = 1 + 1 + sampled["samples_per_prompt"]  # main's greedy, sampled-answers', these
    assert x4["regenerate"]["samples_per_prompt"] == answers and x4["regenerate"]["greedy_first"]
    assert {k: x4["extract"][k] for k in cells["fp4"]["extract"]} == cells["fp4"]["extract"]
    assert x4["train"]["epochs"] == cells["x4"]["train"]["epochs"]
    recipe = load_config(REPO / "configs" / "smollm2-sharegpt.yaml").raw
    assert x4["prompts"] == recipe["prompts"] and x4["drafter"] == recipe["drafter"]


def test_qwen3_recipe_values():
    raw = load_config(REPO / "configs" / "qwen3-8b.yaml").raw
    assert raw["target"]["model"] == "Qwen/Qwen3-8B"
    assert raw["devices"] == {"extract": [0, 1, 2, 3, 4], "train": [5, 6, 7]}
    assert raw["drafter"]["target_layer_ids"] == [1, 9, 17, 25, 33]
    assert (raw["drafter"]["block_size"], raw["drafter"]["num_layers"]) == (16, 5)
    assert (raw["train"]["num_anchors"], raw["train"]["max_length"]) == (512, 3072)
    assert (raw["train"]["lr"], raw["train"]["epochs"]) == (6e-4, 6)
    assert {s["kind"] for s in raw["prompts"]["sources"]} == {"hf"}


def test_defaults_are_filled(tmp_path):
    cfg = Config.from_dict(base_config(tmp_path))
    assert cfg.devices.extract == "auto" and cfg.devices.train == "auto"
    assert cfg.prompts.expand_turns is True
    assert cfg.prompts.sources[0].split == "both"
    assert "{prompt}" in cfg.prompts.sources[3].template
    assert cfg.raw["extract"]["codec"] == "bf16-zstd"


def _error(raw) -> str:
    with pytest.raises(ConfigError) as e:
        Config.from_dict(raw)
    return str(e.value)


def test_unknown_key_is_named(tmp_path):
    raw = base_config(tmp_path)
    raw["prompts"]["seeed"] = 3
    msg = _error(raw)
    assert "prompts" in msg and "'seeed'" in msg and "seed" in msg


def test_unknown_nested_key_in_source(tmp_path):
    raw = base_config(tmp_path)
    raw["prompts"]["sources"][1]["pth"] = "x"
    assert "prompts.sources[1]" in _error(raw)


def test_wrong_type_names_key_and_value(tmp_path):
    raw = base_config(tmp_path)
    raw["prompts"]["seed"] = "abc"
    msg = _error(raw)
    assert "prompts.seed" in msg and "integer" in msg and "'abc'" in msg


def test_device_listed_twice(tmp_path):
    raw = base_config(tmp_path)
    raw["devices"] = {"extract": [0, 1, 1], "train": [2]}
    msg = _error(raw)
    assert "devices.extract" in msg and "[1]" in msg


def test_devices_bad_value(tmp_path):
    raw = base_config(tmp_path)
    raw["devices"] = {"train": "all"}
    assert "devices.train" in _error(raw)


def test_missing_required_and_bad_enum(tmp_path):
    raw = base_config(tmp_path)
    del raw["prompts"]["sources"][0]["kind"]
    raw["prompts"]["sources"][1]["kind"] = "csv"
    msg = _error(raw)
    assert "prompts.sources[0]: 'kind' is missing" in msg
    assert "prompts.sources[1].kind" in msg


def test_semantic_checks(tmp_path):
    raw = base_config(tmp_path)
    raw["prompts"]["sources"][1]["name"] = "share"
    assert "['share'] used more than once" in _error(raw)
    raw = base_config(tmp_path)
    del raw["prompts"]["sources"][2]["path"]
    assert "'pq': kind parquet needs `path`" in _error(raw)
    raw = base_config(tmp_path)
    raw["prompts"]["sources"][3]["template"] = "no placeholder"
    assert "template must contain {prompt}" in _error(raw)


def test_reserved_path_names(tmp_path):
    raw = base_config(tmp_path)
    raw["prompts"]["sources"].append({"name": "std", "kind": "python", "path": "<stdlib>"})
    std = Config.from_dict(raw).prompts.sources[-1]
    assert std.path == "<stdlib>" and std.file is None  # no workflow input to make or wait for
    assert Config.from_dict(raw).prompts.sources[0].file == raw["prompts"]["sources"][0]["path"]
    raw["prompts"]["sources"][-1]["path"] = "<stdlibs>"
    assert "prompts.sources 'std': path <stdlibs> (kind python) is not a known reserved" in _error(
        raw
    )
    raw["prompts"]["sources"][-1].update(path="<stdlib>", kind="jsonl")
    assert "'std': path <stdlib> (kind jsonl) is not a known reserved name" in _error(raw)


def test_retrieve_entry_checked(tmp_path):
    raw = base_config(tmp_path)
    raw["retrieve"] = {
        "x": {"package": "pkg>=1", "member": "a", "sha256": "0" * 64, "dest": "resources/a"}
    }
    assert "retrieve.x.package" in _error(raw)


def test_cli_reports_error_without_traceback(tmp_path):
    raw = base_config(tmp_path)
    raw["prompts"]["bogus"] = 1
    path = write_yaml(tmp_path / "bad.yaml", raw)
    done = subprocess.run(
        [sys.executable, "-m", "dflashpipe", "check-config", "--config", str(path)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 2
    assert "bogus" in done.stderr and "Traceback" not in done.stderr


def test_cli_prints_resolved_config(tmp_path, data_dir):
    path = write_yaml(tmp_path / "ok.yaml", base_config(data_dir))
    done = subprocess.run(
        [sys.executable, "-m", "dflashpipe", "check-config", "--config", str(path)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert yaml.safe_load(done.stdout)["regenerate"]["enabled"] is True


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")


def test_evaluate_tree_settings_checked(tmp_path):
    raw = base_config(tmp_path)
    raw["evaluate"] = {"tree_nodes": [16, 0]}
    assert "evaluate.tree_nodes[1]: 0 is less than the minimum of 1" in _error(raw)
    raw["evaluate"] = {"methods": ["target", "dflash", "medusa"], "engine": "vllm"}
    msg = _error(raw)
    assert "evaluate.methods[2]: 'medusa' is not one of" in msg and "evaluate.engine" in msg
    raw["evaluate"] = {"tree_nodes": []}
    assert "evaluate.tree_nodes: [] should be non-empty" in _error(raw)
    evaluate = Config.from_dict(base_config(tmp_path)).raw["evaluate"]
    assert evaluate["tree_nodes"] == [16, 32, 64, 128] and "ddtree" in evaluate["methods"]


def test_soft_target_keys_default_off_and_are_checked(tmp_path):
    import dataclasses

    cfg = Config.from_dict(base_config(tmp_path))
    assert (cfg.extract.topk, cfg.train.distill_weight) == (0, 0)
    raw = base_config(tmp_path)
    raw.update(extract={"topk": -1}, train={"distill_weight": 1.5})
    msg = _error(raw)
    assert "extract.topk: -1 is less than the minimum of 0" in msg
    assert "train.distill_weight: 1.5 is greater than the maximum of 1" in msg
    with pytest.raises(ConfigError, match=r"train\.distill_weight: -0\.1 is less than the minimum"):
        dataclasses.replace(cfg.train, distill_weight=-0.1)  # made without the schema
    with pytest.raises(ConfigError, match=r"extract\.topk: -2 is less than the minimum of 0"):
        dataclasses.replace(cfg.extract, topk=-2)


def test_train_loss_defaults_to_decay_cross_entropy_and_is_checked(tmp_path):
    """train.loss (issue 62): unset, its keys take today's loss and the section stays out of the
    resolved config; each refusal names the key, including settings that would do nothing."""
    import dataclasses

    from dflashpipe.preflight import check_config

    cfg = Config.from_dict(base_config(tmp_path))
    loss = cfg.train.loss
    assert (loss.objective, loss.weighting, loss.dpace_mix, loss.kl_temperature, loss.labels,
            loss.length_share) == ("cross_entropy", "decay", 0.5, 1.0, "sampled", 0.5)  # fmt: skip
    assert "loss" not in cfg.raw["train"] and not cfg.extract.final_hidden
    assert loss.needs_target() == []

    def refused(train, extract=None):
        raw = base_config(tmp_path)
        raw.update(train=train, extract=extract or {})
        with pytest.raises(ConfigError) as e:
            check_config(Config.from_dict(raw))
        return str(e.value)

    cases = [
        ({"loss": {"objective": "cap"}}, "train.loss.objective: 'cap' is not one of"),
        ({"loss": {"weighting": "linear"}}, "train.loss.weighting: 'linear' is not one of"),
        ({"loss": {"labels": "argmax"}}, "train.loss.labels: 'argmax' is not one of"),
        ({"loss": {"kl_temperature": -1}}, "train.loss.kl_temperature: -1 is less than or equal"),
        ({"loss": {"weighting": "dpace", "dpace_mix": -0.1}}, "train.loss.dpace_mix: -0.1 is less"),
        ({"loss": {"dpace_mix": 0.3}}, "train.loss.dpace_mix is 0.3 with train.loss.weighting"),
        ({"loss": {"kl_temperature": 2}}, "train.loss.kl_temperature is 2, but the loss has no KL"),
        ({"loss": {"objective": "expected_length", "weighting": "dpace"}},
         "train.loss.weighting is 'dpace' with train.loss.objective expected_length"),
        ({"loss": {"objective": "expected_length"}, "rank_weight": 0.2},
         "expected_length mixes with decay cross-entropy only (train.loss.length_share)"),
        ({"loss": {"objective": "expected_length", "length_share": 0}},
         "train.loss.length_share: 0 is less than or equal to the minimum of 0"),
        ({"loss": {"objective": "expected_length", "length_share": 1.5}},
         "train.loss.length_share: 1.5 is greater than the maximum of 1"),
        ({"loss": {"length_share": 0.8}},
         "train.loss.length_share is 0.8 with train.loss.objective 'cross_entropy'"),
        ({"loss": {"objective": "forward_kl"}, "distill_weight": 0.5},
         "train.distill_weight is 0.5 with train.loss.objective forward_kl"),
        ({"loss": {"objective": "forward_kl"}}, "extract.final_hidden off, extract.topk 0"),
        ({"loss": {"labels": "greedy"}}, "train.loss.labels greedy trains on the target's"),
    ]  # fmt: skip
    for train, named in cases:
        assert named in refused(train), (train, named)
    ok = base_config(tmp_path)
    ok.update(extract={"final_hidden": True},
              train={"loss": {"objective": "forward_kl", "kl_temperature": 2.0}, "rank_weight": 0.25})  # fmt: skip
    cfg = Config.from_dict(ok)
    check_config(cfg)
    assert cfg.train.loss.needs_target(0.1) == [
        "train.loss.objective forward_kl",
        "train.distill_weight 0.1",
    ]
    with pytest.raises(ConfigError, match=r"train\.loss\.labels: 'x' is not one of"):
        dataclasses.replace(cfg.train.loss, labels="x")  # made without the schema


def test_drafter_architecture_and_train_selector(tmp_path):
    """Issue 63: unset, the drafter is dflash with no selector; the DFlash2 sizes and
    train.selector (and evaluate.selector) are refused on a dflash drafter naming the key,
    FSDP2 on a dflash2 one;
    alpha's schedule: 0 through the warm-up, then a linear ramp to alpha."""
    from dflashpipe.config import SelectorConfig
    from dflashpipe.preflight import check_config

    cfg = Config.from_dict(base_config(tmp_path))
    assert cfg.drafter.architecture == "dflash" and cfg.train.selector is None
    assert cfg.drafter.model_fields() == {"architecture": "dflash"}

    def refused(drafter, train=None, evaluate=None):
        raw = base_config(tmp_path)
        raw.update(drafter=drafter, train=train or {})
        raw["evaluate"] = raw.get("evaluate", {}) | (evaluate or {})
        with pytest.raises(ConfigError) as e:
            check_config(Config.from_dict(raw))
        return str(e.value)

    cases = [
        ({"selector_top_k": 8}, None, "drafter.selector_top_k is 8 with drafter.architecture dflash"),
        ({"architecture": "dflash", "conv_kernel_size": 3}, None,
         "drafter.conv_kernel_size is 3 with drafter.architecture dflash"),
        ({}, {"selector": {}}, "train.selector is set with drafter.architecture dflash"),
        ({"architecture": "dflash2"}, {"parallel": "fsdp"},
         "train.parallel fsdp with drafter.architecture dflash2"),
        ({"architecture": "dflash3"}, None, "drafter.architecture: 'dflash3' is not one of"),
        ({"architecture": "dflash2", "selector_rank": 0}, None,
         "drafter.selector_rank: 0 is less than the minimum of 1"),
        ({"architecture": "dflash2"}, {"selector": {"alpha": -1}},
         "train.selector.alpha: -1 is less than the minimum of 0"),
    ]  # fmt: skip
    for drafter, train, named in cases:
        assert named in refused(drafter, train), (drafter, train, named)
    assert "evaluate.selector is set with drafter.architecture dflash" in refused(
        {}, None, {"selector": False}
    )
    assert "evaluate.selector: expected boolean, got 'unary'" in refused(
        {"architecture": "dflash2"}, None, {"selector": "unary"}
    )
    raw = base_config(tmp_path)
    raw.update(drafter={"architecture": "dflash2", "selector_top_k": 8},
               train={"selector": {"alpha": 2.0, "warmup_steps": 3, "ramp_steps": 4}})  # fmt: skip
    cfg = Config.from_dict(raw)
    check_config(cfg)
    assert cfg.drafter.model_fields() == {"architecture": "dflash2", "selector_top_k": 8}
    schedule = [cfg.train.selector.alpha_at(s) for s in range(9)]
    assert schedule == [0, 0, 0, 0.5, 1.0, 1.5, 2.0, 2.0, 2.0]
    assert SelectorConfig(alpha=0.3).alpha_at(0) == 0.3  # no warm-up, no ramp: alpha at once
    default = SelectorConfig()
    assert (default.alpha, default.stop_gradient, default.outside_top_k) == (1.0, False, "skip")


def test_the_package_reads_the_workflows_schema():
    """src/dflashpipe/config.schema.yaml is a link to workflow/schemas/config.schema.yaml (the
    one Snakemake validates against), so an edit of either is an edit of both: an editor that
    replaces the link by a file (sed -i does) would fork the two silently."""
    package = REPO / "src" / "dflashpipe" / "config.schema.yaml"
    workflow = REPO / "workflow" / "schemas" / "config.schema.yaml"
    assert package.is_symlink() and package.resolve() == workflow.resolve()


def test_sampled_answers_default_to_greedy_labels_from_a_stored_top1(tmp_path):
    """Issue 62: where regenerate samples the answers and train.loss.labels is unset, labels are
    greedy and extract.topk 1 (the target's argmax); a set key wins, the KL's distribution stays
    the user's, and greedy answers (temperature 0) keep every default and digest as before."""
    from dflashpipe import stages

    def cfg(regenerate=None, extract=None, train=None):
        raw = base_config(tmp_path)
        for name, section in (("regenerate", regenerate), ("extract", extract), ("train", train)):
            if section is not None:
                raw[name] = section
        return Config.from_dict(raw)

    sampled = {"temperature": 0.7, "samples_per_prompt": 2}
    c = cfg(sampled)
    assert (c.extract.topk, c.train.loss.labels) == (1, "greedy")
    c = cfg(sampled, train={"loss": {"labels": "sampled"}})  # the user's labels: no top-k stored
    assert (c.extract.topk, c.train.loss.labels) == (0, "sampled")
    c = cfg(sampled, extract={"topk": 0})  # no distribution: sampled labels, not a refusal
    assert (c.extract.topk, c.train.loss.labels) == (0, "sampled")
    c = cfg(sampled, extract={"topk": 4})
    assert (c.extract.topk, c.train.loss.labels) == (4, "greedy")
    # the KL reads the distribution: its source is the user's (a top-1 would be one-hot)
    c = cfg(sampled, extract={"final_hidden": True}, train={"loss": {"objective": "forward_kl"}})
    assert (c.extract.topk, c.train.loss.labels) == (0, "greedy")
    c = cfg(sampled, train={"distill_weight": 0.5})
    assert (c.extract.topk, c.train.loss.labels) == (0, "sampled")
    c = cfg({"temperature": 0.7, "enabled": False})  # the datasets' own answers
    assert (c.extract.topk, c.train.loss.labels) == (0, "sampled")
    # greedy answers: nothing changes, not even train's digest (train.loss stays unset)
    greedy, plain = cfg({"temperature": 0.0}), cfg()
    assert (greedy.extract.topk, greedy.train.loss.labels) == (0, "sampled")
    assert "loss" not in greedy.raw["train"]
    for stage in ("extract", "train"):
        assert stages.digest(greedy, stage) == stages.digest(plain, stage)
    # the derived values enter the digests: sampled answers' extract and train differ from
    # the same config with sampled labels set
    derived, kept = cfg(sampled), cfg(sampled, train={"loss": {"labels": "sampled"}})
    assert stages.digest(derived, "extract") != stages.digest(kept, "extract")
    assert stages.digest(derived, "train") != stages.digest(kept, "train")
