import json
from pathlib import Path

import matplotlib.image as mpimg
import pytest

from dflashpipe.errors import DataError
from dflashpipe.report import run

EVAL = {
    "acceptance_length": 2.5, "per_source": {"sharegpt": 2.25, "humaneval": 2.75},
    "histogram": {"1": 3, "2": 5, "3": 2, "4": 0}, "lossless_fraction": 1.0, "speedup": 1.8,
    "num_prompts": 4, "run_dtype": "float32", "device": "cpu",
    "tokens_per_s": {"target_only": 10.0, "speculative": 18.0},
    "baseline": {"prompt_lookup": {"acceptance_length": 1.9, "speedup": 1.3, "tokens_per_s": 13.0}},
}  # fmt: skip


def _inputs(tmp_path):
    rows = [{"step": s, "loss": 5.0 / s, "slot_accuracy": [0.5 / s, 0.3 / s, 0.1 / s],
             "expected_acceptance": 1 + 0.5 / s} for s in (1, 2, 3)]  # fmt: skip
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "eval.json").write_text(json.dumps(EVAL))
    stats = {"totals": {"train": 10, "eval": 4, "dropped": {"duplicate": 1}}}
    (tmp_path / "stats.json").write_text(json.dumps(stats))
    manifest = {"totals": {"samples": 10, "tokens": 500, "bytes": 1e6}, "codec": "bf16-zstd",
                "layer_ids": [1, 2], "target": {"name": "tiny"}}  # fmt: skip
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    return [str(tmp_path / n) for n in ("train.jsonl", "eval.json", "stats.json", "manifest.json")]


def test_plots_open_and_summary_has_the_numbers(tmp_path):
    run(
        *_inputs(tmp_path),
        str(tmp_path / "results" / "report"),
        str(tmp_path / "results" / "report.md"),
    )
    for name in ("loss", "acceptance", "histogram"):
        image = mpimg.imread(tmp_path / "results" / "report" / f"{name}.png")
        assert image.shape[0] > 100 and image.shape[1] > 100
    md = (tmp_path / "results" / "report.md").read_text()
    assert "**2.500**" in md and "| humaneval | 2.750 |" in md and "**1.80x**" in md
    assert "![loss](report/loss.png)" in md and "3 optimizer steps" in md
    assert "| prompt lookup | 13.0 |" in md  # metrics from before `methods` existed
    assert not (tmp_path / "results" / "report" / "ddtree.png").exists() and "ddtree" not in md


def test_missing_or_empty_inputs(tmp_path):
    paths = _inputs(tmp_path)
    (tmp_path / "train.jsonl").write_text("")
    with pytest.raises(DataError, match="holds no training metrics"):
        run(*paths, str(tmp_path / "r"), str(tmp_path / "r.md"))
    with pytest.raises(DataError, match="not found"):
        run(str(tmp_path / "nope.jsonl"), *paths[1:], str(tmp_path / "r"), str(tmp_path / "r.md"))


def test_held_out_measurements_are_plotted_and_summarized(tmp_path):
    paths = _inputs(tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    rows[2].update(val_loss=4.5, val_slot_accuracy=[0.2, 0.1, 0.0], val_expected_acceptance=1.22)
    rows[2].update(train_samples=1234, train_tokens=456789)  # what train counts now
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run(*paths, str(tmp_path / "report"), str(tmp_path / "report.md"))
    md = (tmp_path / "report.md").read_text()
    assert "on held-out samples (step 3): loss 4.5000, expected acceptance length 1.220" in md
    assert "3 optimizer steps on 1,234 samples (456,789 tokens an epoch); final loss" in md
    assert mpimg.imread(tmp_path / "report" / "acceptance.png").shape[0] > 100


@pytest.mark.parametrize("tokens, said", [(18_214, True), (11_000_000, False)])
def test_a_drafter_trained_on_few_tokens_is_called_a_demonstration(tmp_path, tokens, said):
    """The embedded default's drafter (about 18K tokens) is no useful drafter, and the report
    says so and names the GPU recipe; one trained on the recipe's 11 M tokens gets no such word."""
    paths = _inputs(tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    rows[-1].update(train_samples=95, train_tokens=tokens)
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run(*paths, str(tmp_path / "report"), str(tmp_path / "report.md"))
    md = (tmp_path / "report.md").read_text()
    sentence = (
        f"This drafter trained on {tokens:,} tokens an epoch, a demonstration of the pipeline"
    )
    assert (sentence in md) is said
    assert ("`configs/smollm2-sharegpt.yaml`" in md) is said


def test_paired_counts_and_extra_features_are_summarized(tmp_path):
    paths = _inputs(tmp_path)
    ev = json.loads((tmp_path / "eval.json").read_text())
    ev["baseline"]["prompt_lookup"].update(
        per_source={"sharegpt": 2.0, "humaneval": 2.5},
        dflash_ahead={"humaneval": {"ahead": 3, "tied": 0, "behind": 1}},
        best_per_source={"humaneval": "latest n<=3 k=16 all"},
        best="latest n<=3 k=16 all",
        configured="earliest n<=2 k=10 all",
        configured_speedup=1.1,
    )
    (tmp_path / "eval.json").write_text(json.dumps(ev))
    extra = {"totals": {"samples": 7, "tokens": 300, "bytes": 5e5}, "codec": "fp4-zstd",
             "group_size": 32}  # fmt: skip
    (tmp_path / "code.json").write_text(json.dumps(extra))
    run(*paths, str(tmp_path / "r"), str(tmp_path / "r.md"), [str(tmp_path / "code.json")])
    md = (tmp_path / "r.md").read_text()
    assert "| humaneval | 2.750 | 2.500 | `latest n<=3 k=16 all` | 3 of 4 |" in md
    assert "| sharegpt | 2.250 | 2.000 | - | - |" in md  # no configuration, no paired count
    assert "(prompt lookup at its best: 1.900, `latest n<=3 k=16 all`)" in md
    # the timed best's speedup under its own name, the configured one's under the configured name
    assert "(prompt lookup at its best: 1.30x; configured `earliest n<=2 k=10 all`: 1.10x)" in md
    assert "- features: 10 samples, 500 tokens, 1.0 MB (bf16-zstd), layers [1, 2] of tiny" in md
    assert (f"- train.extra_features {tmp_path / 'code.json'}: 7 samples, 300 tokens, 0.5 MB "
            "(fp4-zstd, groups of 32)") in md  # fmt: skip
    with pytest.raises(DataError, match="not found"):
        run(*paths, str(tmp_path / "r"), str(tmp_path / "r.md"), [str(tmp_path / "gone.json")])


def test_methods_and_ddtree_budgets_are_tabled_and_plotted(tmp_path):
    paths = _inputs(tmp_path)
    ev = json.loads((tmp_path / "eval.json").read_text())
    row = {"engine": "static", "decode_tokens_per_s": 18.0, "speedup_against": "target"}
    ev |= {
        "engine": {"kind": "static", "graphs": True, "compiled": True},
        "methods": {
            "target": row
            | {
                "acceptance_length": None,
                "decode_tokens_per_s": 10.0,
                "speedup": 1.0,
                "tokens_per_step": 1.0,
                "step_cost": 1.0,
            },
            "dflash": row
            | {
                "acceptance_length": 2.5,
                "speedup": 1.8,
                "lossless_fraction": 1.0,
                "tokens_per_step": 2.34,
                "step_cost": 1.3,
            },
            "prompt_lookup": row | {"acceptance_length": 1.9, "speedup": 1.3},
        },  # fmt: skip
        "ddtree": {
            n: row | {"acceptance_length": tau, "speedup": s, "lossless_fraction": 1.0}
            for n, tau, s in (("16", 2.9, 1.9), ("32", 3.1, 1.95), ("64", 3.2, 1.7))
        },
    }
    (tmp_path / "eval.json").write_text(json.dumps(ev))
    run(*paths, str(tmp_path / "r"), str(tmp_path / "r.md"))
    md = (tmp_path / "r.md").read_text()
    assert "- engine: static, CUDA graphs, compiled steps" in md
    assert "| target only | static | - | 1.000 | 1.00 | 10.0 | 1.00x vs target | - |" in md
    assert (
        "| DFlash drafter | static | 2.500 | 2.340 | 1.30 | 18.0 | 1.80x vs target | 1.000 |" in md
    )
    assert "| prompt lookup | static | 1.900 | - | - | 18.0 | 1.30x vs target | - |" in md  # older
    assert "| DDTree, 32 nodes | static | 3.100 | - | - | 18.0 | 1.95x vs target | 1.000 |" in md
    assert "![ddtree](r/ddtree.png)" in md
    assert "eager loop:" not in md
    assert mpimg.imread(tmp_path / "r" / "ddtree.png").shape[0] > 100


def test_an_unchecked_run_says_so(tmp_path):
    """evaluate.lossless_check: false leaves lossless_fraction null: the summary says it was not
    checked instead of printing a number."""
    inputs = _inputs(tmp_path)
    Path(inputs[1]).write_text(json.dumps(EVAL | {"lossless_fraction": None}))
    run(*inputs, str(tmp_path / "plots"), str(tmp_path / "report.md"))
    md = (tmp_path / "report.md").read_text()
    assert "lossless fraction (float32): not checked (evaluate.lossless_check: false)" in md


def test_the_serving_lines_are_this_runs(tmp_path, monkeypatch):
    """The README's launch lines with this run's target, drafter directory and block size, and
    vLLM's num_speculative_tokens one less (it does not read block_size)."""
    monkeypatch.chdir(tmp_path)  # the recorded drafter path is relative to the run's directory
    drafter = tmp_path / "results" / "drafter"
    drafter.mkdir(parents=True)
    layers = ["sliding_attention", "full_attention"]
    (drafter / "config.json").write_text(json.dumps({"block_size": 8, "layer_types": layers}))
    (drafter / "mask_embedding.pt").write_bytes(b"")
    paths = _inputs(tmp_path)
    target = "resources/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    info = {"drafter": {"path": "results/drafter", "block_size": 8}, "target": target}
    (tmp_path / "eval.json").write_text(json.dumps(EVAL | info))
    run(*paths, "results/report", "results/report.md")
    md = (tmp_path / "results" / "report.md").read_text()
    serve = md[md.index("## Serve the drafter") :]
    assert f"python -m sglang.launch_server --model-path {target}" in serve
    assert "--speculative-algorithm DFLASH --speculative-draft-model-path results/drafter" in serve
    assert "--speculative-num-draft-tokens 8\n" in serve
    assert (
        f'vllm serve {target} --speculative-config \'{{"method": "dflash", "model": '
        '"results/drafter", "num_speculative_tokens": 7}\'' in serve
    )
    assert "VLLM_USE_V2_MODEL_RUNNER=1" in serve and "mask_embedding.pt" in serve
    (tmp_path / "eval.json").write_text(json.dumps(EVAL))  # metrics without a drafter record
    run(*paths, "results/report", "results/report.md")
    assert "Serve the drafter" not in (tmp_path / "results" / "report.md").read_text()


def test_a_run_on_the_eager_loop_says_why_under_its_methods_table(tmp_path):
    """A family the static engine does not cover: the methods table's rows say eager, and the
    line under it the reason (from metrics.json's engine entry) and that DDTree was not run."""
    paths = _inputs(tmp_path)
    ev = json.loads((tmp_path / "eval.json").read_text())
    row = {"engine": "eager", "decode_tokens_per_s": 9.0, "speedup_against": "target",
           "acceptance_length": 2.0, "speedup": 1.2}  # fmt: skip
    reason = "StaticTarget supports model types (...), not 'gpt2'; decode it with the eager loop"
    ev |= {
        "engine": {"kind": "eager", "graphs": False, "compiled": False, "reason": reason},
        "methods": {"target": row | {"acceptance_length": None, "speedup": 1.0}, "dflash": row},
        "ddtree": {},
    }
    (tmp_path / "eval.json").write_text(json.dumps(ev))
    run(*paths, str(tmp_path / "r"), str(tmp_path / "r.md"))
    md = (tmp_path / "r.md").read_text()
    assert "- engine: eager (why: below the methods table)" in md
    assert "| DFlash drafter | eager | 2.000 |" in md
    table_end = md.index("| DFlash drafter | eager")
    assert md.index(f"eager loop: {reason} (speedups of the eager loop") > table_end
    assert "DDTree needs the static engine: not run" in md
