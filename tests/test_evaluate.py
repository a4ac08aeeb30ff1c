"""Evaluate stage: metrics.json from real decoding, and refusals before any decoding."""

import json

import pytest
import torch
from PIL import Image
from transformers import AutoConfig

from dflashpipe.config import TargetConfig
from dflashpipe.decoding.summary import ahead_per_source
from dflashpipe.decoding.types import Decoded
from dflashpipe.devices import DeviceLease
from dflashpipe.errors import ConfigError, DataError
from dflashpipe.evaluate import (
    EvaluateConfig,
    EvaluatePaths,
    EvaluateSettings,
    check_fit,
    read_eval_prompts,
    run,
)
from dflashpipe.export import save_drafter
from dflashpipe.model import Drafter, DrafterConfig
from dflashpipe.plots import plot_concurrency
from dflashpipe.prompts import Prompt, prompt_key, write_prompts
from dflashpipe.report import under_load

BLOCK = 4


def evaluate(target, drafter_dir, prompts, out, ev, device="cpu") -> dict:
    """evaluate.run on `device`, without a lease (as `--device` runs it)."""
    paths = EvaluatePaths(drafter_dir, prompts, out)
    return run(EvaluateSettings(target, ev), paths, DeviceLease(fixed=str(device)))


def _prompt(source: str, text: str) -> Prompt:
    messages = [{"role": "user", "content": text}]
    return Prompt(prompt_key(messages), source, text[:8], 0, messages, None, f"{source}:x")


def _export(target_config, path, **overrides):
    kw = dict(mask_token_id=0, num_layers=1, block_size=BLOCK, target_layer_ids=[0, 1])
    config = DrafterConfig.from_target(target_config, **(kw | overrides))
    V, H = config.vocab_size, config.hidden_size
    torch.manual_seed(0)
    save_drafter(Drafter(config, torch.randn(V, H), torch.randn(V, H)), path)
    return path


@pytest.fixture(scope="module")
def target_config(tiny_target_dir):
    return AutoConfig.from_pretrained(tiny_target_dir, local_files_only=True)


@pytest.fixture
def eval_table(tmp_path):
    prompts = [
        _prompt("sharegpt", "Tell me about the moon."),
        _prompt("sharegpt", "How do I bake bread?"),
        _prompt("humaneval", "def add(a, b):\n    '''Add two numbers.'''\n"),
        _prompt("humaneval", "word " * 2100),  # longer than the tiny target's 2048 positions
    ]
    write_prompts(tmp_path / "eval.parquet", prompts)
    return tmp_path / "eval.parquet"


def test_metrics_json(tiny_target_dir, target_config, eval_table, tmp_path):
    drafter_dir = _export(target_config, tmp_path / "drafter")
    out = tmp_path / "eval" / "metrics.json"
    ev = EvaluateConfig(
        num_prompts=10, max_new_tokens=10, prompt_lookup_num_tokens=3, tree_nodes=[2, 8]
    )
    metrics = evaluate(
        TargetConfig(model=str(tiny_target_dir)), drafter_dir, eval_table, out, ev, "cpu"
    )
    assert json.loads(out.read_text()) == json.loads(json.dumps(metrics))
    for key in (
        "acceptance_length",
        "per_source",
        "histogram",
        "per_position_acceptance",
        "lossless_fraction",
        "bf16_agreement",
        "speedup",
        "baseline",
    ):
        assert key in metrics, key
    assert metrics["lossless_fraction"] == 1.0 and metrics["first_divergence"] is None
    assert metrics["bf16_agreement"] is None  # float32 on CPU: nothing to compare
    assert metrics["num_prompts"] == 3 and metrics["skipped"]["prompt_too_long"] == 1
    assert set(metrics["per_source"]) == {"sharegpt", "humaneval"}
    assert 1.0 <= metrics["acceptance_length"] <= BLOCK
    assert list(metrics["histogram"]) == ["1", "2", "3", "4"]
    assert sum(metrics["histogram"].values()) == metrics["verify_steps"] > 0
    assert len(metrics["per_position_acceptance"]) == BLOCK - 1
    assert metrics["speedup"] > 0 and metrics["tokens_per_s"]["target_only"] > 0
    lookup = metrics["baseline"]["prompt_lookup"]
    assert lookup["acceptance_length"] >= 1.0 and lookup["tokens_per_s"] > 0
    assert set(lookup["per_source"]) == {"sharegpt", "humaneval"}
    assert min(lookup["per_source"].values()) >= 1.0
    assert lookup["identical_to_target_fraction"] == 1.0
    # the baseline is prompt lookup at its best: per source the highest tau of the configured
    # (timed) lookup and the 48 replayed configurations, named
    assert lookup["configured"] == "earliest n<=2 k=3 all" and len(lookup["sweep"]) == 48
    rows = [{"config": lookup["configured"] + " (timed)", "per_source":
             lookup["configured_per_source"]}, *lookup["sweep"]]  # fmt: skip
    for source, tau in lookup["per_source"].items():
        assert tau == max(r["per_source"][source] for r in rows)
        best = next(r for r in rows if r["config"] == lookup["best_per_source"][source])
        assert best["per_source"][source] == tau
    assert lookup["acceptance_length"] == max(
        lookup["configured_acceptance_length"], *(r["acceptance_length"] for r in lookup["sweep"])
    )
    assert max(r["acceptance_length"] for r in lookup["sweep"]) > min(
        r["acceptance_length"] for r in lookup["sweep"]
    )  # the configurations differ on these prompts: the sweep chose
    best_drafts = int(lookup["best"].split("k=")[1].split()[0])
    assert len(lookup["per_position_acceptance"]) == best_drafts
    assert [r["lossless"] for r in metrics["responses"]] == [True] * 3
    # per prompt, paired: the lookup taus average to its per-source figures, and every prompt
    # with both taus is counted once as ahead, tied or behind, by its own two taus
    for source, tau in lookup["per_source"].items():
        rows = [r for r in metrics["responses"] if r["source"] == source]
        taus = [r["prompt_lookup_acceptance_length"] for r in rows]
        assert sum(taus) / len(taus) == pytest.approx(tau)
        d = [r["acceptance_length"] - r["prompt_lookup_acceptance_length"] for r in rows]
        want = {"ahead": sum(x > 0 for x in d), "tied": sum(x == 0 for x in d),
                "behind": sum(x < 0 for x in d)}  # fmt: skip
        assert lookup["dflash_ahead"][source] == want
    # every method on the static engine, each speedup against its target-only; DDTree per
    # budget, lossless in float32 like DFlash
    assert metrics["engine"] == {"kind": "static", "graphs": False, "compiled": False}
    methods = metrics["methods"]
    assert set(methods) == {"target", "dflash", "prompt_lookup", "prompt_lookup_best"}
    # the baseline's speed is its best configuration's, decoded per source; the configured kept
    assert lookup["tokens_per_s"] == methods["prompt_lookup_best"]["decode_tokens_per_s"]
    assert lookup["speedup"] == methods["prompt_lookup_best"]["speedup"]
    assert lookup["configured_speedup"] == methods["prompt_lookup"]["speedup"]
    for source, tau in lookup["per_source"].items():
        assert lookup["timed_per_source"][source] == pytest.approx(tau)  # replay = decoding
    assert methods["dflash"]["acceptance_length"] == metrics["acceptance_length"]
    # pooled over steps: speedup = tokens per step / step cost, each from the responses
    assert methods["target"]["tokens_per_step"] == methods["target"]["step_cost"] == 1.0
    new_tokens = sum(r["new_tokens"] - 1 for r in metrics["responses"])
    assert methods["dflash"]["tokens_per_step"] == pytest.approx(
        new_tokens / metrics["verify_steps"]
    )
    for m, row in [*methods.items(), *metrics["ddtree"].items()]:
        assert row["speedup"] == pytest.approx(row["tokens_per_step"] / row["step_cost"]), m
    assert methods["dflash"]["lossless_fraction"] == 1.0
    assert {m["engine"] for m in methods.values()} == {"static"}
    assert methods["prompt_lookup"]["speedup_against"] == lookup["speedup_against"] == "target"
    assert lookup["identical_to_target_fraction"] == 1.0
    assert set(metrics["ddtree"]) == {"2", "8"}
    for n, tree in metrics["ddtree"].items():
        assert tree["lossless_fraction"] == 1.0 and tree["first_divergence"] is None, n
        assert 1.0 <= tree["acceptance_length"] <= min(int(n), BLOCK - 1) + 1
        assert tree["speedup"] > 0 and tree["nodes_per_step"] <= int(n)
        assert set(tree["per_source"]) == {"sharegpt", "humaneval"}
    assert all(set(r["ddtree_acceptance_length"]) == {"2", "8"} for r in metrics["responses"])


def test_ahead_counts_pair_prompts_and_skip_those_without_a_verify_step():
    def dec(*accepted):  # one response whose verify steps accepted these lengths
        return Decoded(
            [1] * (1 + sum(accepted)), "length", 0.0, 0.0, list(accepted), [3] * len(accepted)
        )

    rows = [({"source": s}, []) for s in ("a", "a", "a", "b", "b")]
    ours = [dec(3, 1), dec(1), dec(2), dec(2, 2), dec()]
    theirs = [dec(1, 1), dec(1), dec(4), dec(1), dec(3)]
    assert ahead_per_source(rows, ours, theirs) == {
        "a": {"ahead": 1, "tied": 1, "behind": 1},
        "b": {"ahead": 1, "tied": 0, "behind": 0},  # the last prompt: no tau of ours
    }


@pytest.mark.parametrize("engine", ["auto", "eager"])
def test_bf16_run_reports_agreement_and_checks_losslessness_in_float32(
    tiny_target_dir, target_config, eval_table, tmp_path, engine
):
    """The GPU path (bf16 run, then float32 for the lossless check), here on the CPU; the eager
    loop has no tree decoding, so ddtree is left out there (and said so in `engine`)."""
    drafter_dir = _export(target_config, tmp_path / "drafter")
    target = TargetConfig(model=str(tiny_target_dir), dtype="bfloat16")
    ev = EvaluateConfig(num_prompts=1, max_new_tokens=6, tree_nodes=[4], engine=engine)
    metrics = evaluate(target, drafter_dir, eval_table, tmp_path / "m.json", ev, "cpu")
    assert metrics["run_dtype"] == "bfloat16"
    assert 0.0 <= metrics["bf16_agreement"] <= 1.0
    assert metrics["lossless_fraction"] == 1.0
    if engine == "auto":
        assert metrics["engine"]["kind"] == "static"
        assert metrics["ddtree"]["4"]["lossless_fraction"] == 1.0
    else:
        assert metrics["engine"] == {
            "kind": "eager",
            "graphs": False,
            "compiled": False,
            "reason": "evaluate.engine: eager",
        }
        assert metrics["ddtree"] == {} and set(metrics["methods"]) == {
            "target",
            "dflash",
            "prompt_lookup",
            "prompt_lookup_best",
        }
        assert metrics["baseline"]["prompt_lookup"]["speedup_against"] == "target"


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_worker_processes_give_the_same_responses(
    tiny_target_dir, target_config, eval_table, tmp_path, device
):
    """Three prompts over two processes (slices 0::2 and 1::2) decode exactly as in one."""
    drafter_dir = _export(target_config, tmp_path / "drafter")
    target = TargetConfig(model=str(tiny_target_dir))
    one, two = (
        evaluate(target, drafter_dir, eval_table, tmp_path / f"{w}.json",
            EvaluateConfig(num_prompts=10, max_new_tokens=10, workers=w, tree_nodes=[4]),
            device)
        for w in (1, 2)
    )  # fmt: skip
    assert [r["prompt_id"] for r in two["responses"]] == [r["prompt_id"] for r in one["responses"]]
    assert two["responses"] == one["responses"] and len(one["responses"]) == 3
    for key in (
        "acceptance_length",
        "per_source",
        "histogram",
        "verify_steps",
        "lossless_fraction",
    ):
        assert two[key] == one[key], key
    lookup = [m["baseline"]["prompt_lookup"] for m in (one, two)]
    assert lookup[0]["per_source"] == lookup[1]["per_source"]
    assert two["ddtree"]["4"]["per_source"] == one["ddtree"]["4"]["per_source"]
    assert two["engine"] == one["engine"]


@pytest.mark.parametrize(
    "overrides, field, values",
    [
        ({"num_hidden_layers": 8}, "num_target_layers", ("8", "3")),
        ({"num_hidden_layers": 8, "target_layer_ids": [1, 5]}, "target_layer_ids", ("[1, 5]", "3")),
        ({"hidden_size": 32}, "hidden_size", ("32", "64")),
        ({"vocab_size": 1000}, "vocab_size", ("1000", "vocab_size is 1000 in the drafter but")),
    ],
)
def test_a_drafter_for_another_target_is_refused_before_decoding(
    tiny_target_dir, target_config, eval_table, tmp_path, overrides, field, values
):
    other = target_config.to_dict() | {
        k: v for k, v in overrides.items() if k != "target_layer_ids"
    }
    other = type(target_config).from_dict(other)
    ids = {"target_layer_ids": overrides.get("target_layer_ids", [0, 1])}
    drafter_dir = _export(other, tmp_path / "drafter", **ids)
    out = tmp_path / "metrics.json"
    with pytest.raises(DataError, match=field) as err:
        evaluate(
            TargetConfig(model=str(tiny_target_dir)),
            drafter_dir,
            eval_table,
            out,
            EvaluateConfig(num_prompts=1),
            "cpu",
        )
    assert all(v in str(err.value) for v in values), str(err.value)
    assert "config.json" in str(err.value) and not out.exists()


def test_check_fit_accepts_the_drafters_own_target(target_config):
    config = DrafterConfig.from_target(target_config, mask_token_id=0, target_layer_ids=[0, 1])
    check_fit(config, target_config, "drafter")


def test_empty_eval_set_is_an_error(tmp_path):
    write_prompts(tmp_path / "eval.parquet", [])
    with pytest.raises(DataError, match="holds no prompts"):
        read_eval_prompts(tmp_path / "eval.parquet", 4)
    with pytest.raises(DataError, match="not found"):
        read_eval_prompts(tmp_path / "missing.parquet", 4)


def test_prompts_are_taken_round_robin_over_sources(tmp_path):
    prompts = [_prompt("a", f"question a{i}") for i in range(4)] + [_prompt("b", "question b0")]
    write_prompts(tmp_path / "eval.parquet", prompts)
    picked = read_eval_prompts(tmp_path / "eval.parquet", 3)
    assert [r["source"] for r in picked] == ["a", "b", "a"]
    assert len(read_eval_prompts(tmp_path / "eval.parquet", 99)) == 5


def test_only_too_long_prompts_is_an_error(tiny_target_dir, target_config, tmp_path):
    write_prompts(tmp_path / "eval.parquet", [_prompt("x", "word " * 2100)])
    drafter_dir = _export(target_config, tmp_path / "drafter")
    with pytest.raises(DataError, match="prompt_too_long"):
        evaluate(
            TargetConfig(model=str(tiny_target_dir)),
            drafter_dir,
            tmp_path / "eval.parquet",
            tmp_path / "m.json",
            EvaluateConfig(num_prompts=2),
            "cpu",
        )


def test_settings_are_validated():
    with pytest.raises(ConfigError, match="max_new_tokens"):
        EvaluateConfig(max_new_tokens=0)
    with pytest.raises(ConfigError, match=r"evaluate.tree_nodes\[1\]: 0 is less than the minimum"):
        EvaluateConfig(tree_nodes=[16, 0])
    with pytest.raises(ConfigError, match="evaluate.methods\\[2\\]: 'medusa' is not one of"):
        EvaluateConfig(methods=["target", "dflash", "medusa"])
    with pytest.raises(ConfigError, match="evaluate.methods lacks \\['dflash'\\]"):
        EvaluateConfig(methods=["target", "ddtree"])
    with pytest.raises(ConfigError, match="evaluate.engine"):
        EvaluateConfig(engine="vllm")
    with pytest.raises(ConfigError, match="evaluate.tree_top_k"):
        EvaluateConfig(tree_top_k=0)


def test_a_tree_budget_beyond_the_context_is_refused(
    tiny_target_dir, target_config, eval_table, tmp_path
):
    drafter_dir = _export(target_config, tmp_path / "drafter")
    ev = EvaluateConfig(num_prompts=1, max_new_tokens=8, tree_nodes=[16, 2040])
    with pytest.raises(ConfigError, match="evaluate.tree_nodes 2040 .* context of 2048"):
        evaluate(TargetConfig(model=str(tiny_target_dir)), drafter_dir, eval_table,
            tmp_path / "m.json", ev, "cpu")  # fmt: skip


def test_lossless_check_off_skips_the_float32_pass(tiny_target_dir, target_config, eval_table,
                                                    tmp_path, caplog):  # fmt: skip
    """A tau-only run (a lever cell): the bf16 responses are measured as usual, the float32
    pass is skipped and every lossless figure is null rather than a claim."""
    drafter_dir = _export(target_config, tmp_path / "drafter")
    target = TargetConfig(model=str(tiny_target_dir), dtype="bfloat16")
    ev = EvaluateConfig(num_prompts=2, max_new_tokens=6, tree_nodes=[4], lossless_check=False,
                        methods=["target", "dflash", "ddtree"])  # fmt: skip
    with caplog.at_level("WARNING", logger="dflashpipe.evaluate"):
        metrics = evaluate(target, drafter_dir, eval_table, tmp_path / "m.json", ev, "cpu")
    assert "lossless_check is off" in caplog.text
    assert metrics["lossless_fraction"] is None and metrics["first_divergence"] is None
    assert [r["lossless"] for r in metrics["responses"]] == [None, None]
    assert "lossless_fraction" not in metrics["methods"]["dflash"]
    tree = metrics["ddtree"]["4"]
    assert "lossless_fraction" not in tree and tree["first_divergence"] is None
    assert metrics["acceptance_length"] >= 1 and tree["acceptance_length"] >= 1
    assert 0.0 <= metrics["bf16_agreement"] <= 1.0  # the run-dtype figures are all there
    assert metrics["settings"]["lossless_check"] is False


@pytest.mark.parametrize("workers, checked", [(1, 2), (2, 2), (2, 1)])
def test_lossless_prompts_checks_the_first_prompts_alone(
    tiny_target_dir, target_config, eval_table, tmp_path, workers, checked
):
    """evaluate.lossless_prompts of 3 prompts: the float32 pass decodes the first ones (in one
    process, or each slice its share, none in a slice that holds none of them), their responses
    carry a verdict and the others none, and the fractions count the checked ones; tau and
    speeds still cover all three."""
    drafter_dir = _export(target_config, tmp_path / "drafter")
    target = TargetConfig(model=str(tiny_target_dir), dtype="bfloat16")
    ev = EvaluateConfig(num_prompts=10, max_new_tokens=6, tree_nodes=[4], lossless_prompts=checked,
                        workers=workers, methods=["target", "dflash", "ddtree"])  # fmt: skip
    metrics = evaluate(target, drafter_dir, eval_table, tmp_path / "m.json", ev, "cpu")
    verdicts = [r["lossless"] for r in metrics["responses"]]
    assert len(verdicts) == 3 and None not in verdicts[:checked]
    assert verdicts[checked:] == [None] * (3 - checked)
    assert metrics["lossless_prompts"] == checked and metrics["lossless_fraction"] == 1.0
    assert metrics["ddtree"]["4"]["lossless_fraction"] == 1.0
    assert all(r["acceptance_length"] is not None for r in metrics["responses"])


def test_the_best_prompt_lookup_fits_the_engine_without_ddtree(
    target_config, tiny_target_dir, tmp_path
):
    """The sweep's best prompt lookup may draft 16 tokens where the configured one drafts 10:
    the engine's buffers make room for it even where no DDTree budget or larger block widens
    them (the CPU default's evaluate stopped on its longest prompt so)."""
    from dflashpipe.decoding.lookup import LookupConfig
    from dflashpipe.decoding.runner import Decoders
    from dflashpipe.evaluate import load_models, slack

    ev = EvaluateConfig(methods=["target", "dflash", "prompt_lookup"], max_new_tokens=8)
    assert slack(ev, BLOCK) == 17
    assert slack(EvaluateConfig(methods=ev.methods, prompt_lookup_sweep=False), BLOCK) == 11
    drafter_dir = _export(target_config, tmp_path / "drafter")
    model, _, drafter = load_models(
        TargetConfig(model=str(tiny_target_dir)), drafter_dir, torch.device("cpu")
    )
    ids = [5, 6, 7, 5, 6, 7, 5, 6]
    decoders = Decoders(model, drafter, ev.methods, "auto", len(ids) + 8 + slack(ev, BLOCK))
    best = LookupConfig(16, 2, "earliest", "all")  # the grid's most drafts
    [out] = decoders.lookup_all([({}, ids)], [best], 8, set(), "best")
    assert len(out.output_ids) == 8


def test_concurrency_levels_decode_the_same_answers(tiny_target_dir, target_config, eval_table,
                                                    tmp_path):  # fmt: skip
    """evaluate.concurrency [2, 5]: the 3 prompts that fit decoded 2 and 5 at a time (a refill;
    more rows than prompts) and 1 at a time, each method's answers and DFlash's tau equal the
    per-prompt pass's in float32, and speedups are against target-only at the same level."""
    drafter_dir = _export(target_config, tmp_path / "drafter")
    ev = EvaluateConfig(num_prompts=10, max_new_tokens=8, prompt_lookup_num_tokens=3,
                        methods=["target", "dflash", "prompt_lookup"], concurrency=[2, 5],
                        concurrency_waves=1, lossless_prompts=1)  # fmt: skip
    metrics = evaluate(TargetConfig(model=str(tiny_target_dir)), drafter_dir, eval_table,
                  tmp_path / "m.json", ev, "cpu")  # fmt: skip
    figures = metrics["concurrency"]
    assert sorted(figures["levels"], key=int) == ["1", "2", "5"] and figures["largest"] == 5
    for c, row in figures["levels"].items():
        assert set(row) == {"target", "dflash", "prompt_lookup"}, c
        assert all(r["same_as_one_at_a_time"] == 1.0 for r in row.values()), c
        assert all(r["passes"] == 1 for r in row.values()), c  # waves 1: 5 rows hold 1 pass of 3
        assert row["target"]["speedup"] == 1.0 and row["dflash"]["tokens_per_s"] > 0
        assert row["dflash"]["acceptance_length"] == pytest.approx(metrics["acceptance_length"])
        ratio = row["dflash"]["tokens_per_s"] / row["target"]["tokens_per_s"]
        assert row["dflash"]["speedup"] == pytest.approx(ratio)
        assert row["target"]["step_cost"] == 1.0
        # rows advance together: a level's steps are at least its longest answer's
        assert row["target"]["steps"] >= max(r["new_tokens"] for r in metrics["responses"]) - 1
        assert row["dflash"]["steps"] <= row["target"]["steps"]  # a block gives >= 1 token
        for r in row.values():  # where the wall time went: refills (in the steps), host work
            assert 1 <= r["prefills"] <= 3 and r["refill"] == "step" and r["prefill_share"] == 0
            assert r["host_ms_per_step"] > 0 and r["step_ms"] > 0
        if int(c) >= 3:  # rows for every prompt: one refill pack holds them all
            assert all(r["prefills"] == 1 for r in row.values()), c
        # prompt lookup under load at each source's best setting of the sweep
        sweep = {
            r["config"]: r["per_source"] for r in metrics["baseline"]["prompt_lookup"]["sweep"]
        }
        for source, name in row["prompt_lookup"]["settings"].items():
            assert sweep[name][source] == max(t[source] for t in sweep.values()), (c, source)
    below = [int(c) for c, r in figures["levels"].items() if r["dflash"]["speedup"] < 1.0]
    assert figures["dflash_below_target_at"] == (min(below) if below else None)
    # the report draws and tables them
    plot_concurrency(metrics, tmp_path / "concurrency.png")
    assert Image.open(tmp_path / "concurrency.png").size[0] > 0
    text = under_load(metrics, "img")
    rows = [line for line in text.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [r.split(" | ")[0][2:] for r in rows] == ["1", "2", "5"]
    assert ("slower than target-only from concurrency" in text) == bool(below)
    assert all(r.split(" | ")[6].endswith("packs, in steps") for r in rows)
    for row in figures["levels"].values():  # refills apart (concurrency_refill: pack): a share
        row["dflash"].update(refill="pack", prefill_share=0.25)
    assert all(r.split(" | ")[6] == "25% of its time" for r in under_load(metrics, "img").splitlines()
               if r.startswith("| ") and r[2].isdigit())  # fmt: skip
    assert under_load({k: v for k, v in metrics.items() if k != "concurrency"}, "img") == ""


def test_a_load_level_queues_the_prompts_in_whole_passes(tiny_target_dir, target_config,
                                                          eval_table, tmp_path):  # fmt: skip
    """evaluate.concurrency_waves 3 at c = 2 over the 3 prompts: 6 fit, so every prompt is
    decoded twice at that level (a steady state for a small prompt set) and once at c = 1; each
    pass gives the per-prompt pass's answers in float32 and the same tau."""
    drafter_dir = _export(target_config, tmp_path / "drafter")
    ev = EvaluateConfig(num_prompts=10, max_new_tokens=8, methods=["target", "dflash"],
                        concurrency=[2], concurrency_waves=3, lossless_prompts=1)  # fmt: skip
    metrics = evaluate(TargetConfig(model=str(tiny_target_dir)), drafter_dir, eval_table,
                  tmp_path / "m.json", ev, "cpu")  # fmt: skip
    levels = metrics["concurrency"]["levels"]
    answered = sum(r["new_tokens"] for r in metrics["responses"])
    for c, passes in (("1", 1), ("2", 2)):
        for m, r in levels[c].items():
            assert r["passes"] == passes and r["same_as_one_at_a_time"] == 1.0, (c, m)
            assert round(r["tokens_per_s"] * r["wall_s"]) == passes * answered, (c, m)
        assert levels[c]["dflash"]["acceptance_length"] == pytest.approx(
            metrics["acceptance_length"]
        )


@pytest.mark.parametrize("levels", [[0], [10**9]])
def test_a_concurrency_that_cannot_run_is_refused_before_decoding(
    tiny_target_dir, target_config, eval_table, tmp_path, levels
):
    """Below 1 (the schema) or beyond the memory's K/V buffers: refused naming the key, with
    no metrics written."""
    drafter_dir = _export(target_config, tmp_path / "drafter")
    out = tmp_path / "m.json"
    with pytest.raises(ConfigError, match="evaluate.concurrency"):
        ev = EvaluateConfig(num_prompts=2, max_new_tokens=6, concurrency=levels)
        evaluate(TargetConfig(model=str(tiny_target_dir)), drafter_dir, eval_table, out, ev, "cpu")
    assert not out.exists()
