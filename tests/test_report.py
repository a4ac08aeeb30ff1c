import ast
import dataclasses
import json
import random
from pathlib import Path

import matplotlib.image as mpimg
import pytest

import dflashpipe
from dflashpipe.decoding.lookup import GRID, LookupConfig, PromptLookupProposer, replay, sweep
from dflashpipe.decoding.summary import summarize
from dflashpipe.decoding.types import Decoded
from dflashpipe.errors import DataError
from dflashpipe.report import ReportPaths, run
from dflashpipe.serving import GGUF_FLAGS
from dflashpipe.sources import DROP_REASONS, DropLog

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
        ReportPaths(
            *_inputs(tmp_path),
            str(tmp_path / "results" / "report"),
            str(tmp_path / "results" / "report.md"),
        )
    )
    for name in ("loss", "acceptance", "histogram"):
        image = mpimg.imread(tmp_path / "results" / "report" / f"{name}.png")
        assert image.shape[0] > 100 and image.shape[1] > 100
    md = (tmp_path / "results" / "report.md").read_text()
    assert "**2.500**" in md and "| humaneval | - | 2.750 |" in md and "**1.80x**" in md
    assert "![loss](report/loss.png)" in md and "3 optimizer steps" in md
    assert "| prompt lookup | 13.0 |" in md  # metrics from before `methods` existed
    assert not (tmp_path / "results" / "report" / "ddtree.png").exists() and "ddtree" not in md


def test_missing_or_empty_inputs(tmp_path):
    paths = _inputs(tmp_path)
    (tmp_path / "train.jsonl").write_text("")
    with pytest.raises(DataError, match="holds no training metrics"):
        run(ReportPaths(*paths, str(tmp_path / "r"), str(tmp_path / "r.md")))
    with pytest.raises(DataError, match="not found"):
        run(
            ReportPaths(
                str(tmp_path / "nope.jsonl"),
                *paths[1:],
                str(tmp_path / "r"),
                str(tmp_path / "r.md"),
            )
        )


def test_held_out_measurements_are_plotted_and_summarized(tmp_path):
    paths = _inputs(tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    rows[2].update(val_loss=4.5, val_slot_accuracy=[0.2, 0.1, 0.0], val_expected_acceptance=1.22,
                   val_chain_acceptance=1.25)  # fmt: skip
    rows[2].update(train_samples=1234, train_tokens=456789)  # what train counts now
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run(ReportPaths(*paths, str(tmp_path / "report"), str(tmp_path / "report.md")))
    md = (tmp_path / "report.md").read_text()
    assert ("on held-out samples (step 3): loss 4.5000, expected acceptance length 1.220 "
            "(1.250 along its drafted chains)") in md  # fmt: skip
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
    run(ReportPaths(*paths, str(tmp_path / "report"), str(tmp_path / "report.md")))
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
    run(
        ReportPaths(
            *paths, str(tmp_path / "r"), str(tmp_path / "r.md"), [str(tmp_path / "code.json")]
        )
    )
    md = (tmp_path / "r.md").read_text()
    assert "| humaneval | - | 2.750 | 2.500 | `latest n<=3 k=16 all` | 3 of 4 |" in md
    assert "| sharegpt | - | 2.250 | 2.000 | - | - |" in md  # no configuration, no paired count
    assert "prompt lookup's: 1.900 for the one configuration best over all prompts (`latest" in md
    # the timed best's speedup under its own name, the configured one's under the configured name
    assert ("prompt lookup's: **1.30x** at its best (each source's best configuration); 1.10x as "
            "configured (`earliest n<=2 k=10 all`)") in md  # fmt: skip
    assert "- features: 10 samples, 500 tokens, 1.0 MB (bf16-zstd), layers [1, 2] of tiny" in md
    assert (f"- train.extra_features {tmp_path / 'code.json'}: 7 samples, 300 tokens, 0.5 MB "
            "(fp4-zstd, groups of 32)") in md  # fmt: skip
    with pytest.raises(DataError, match="not found"):
        run(
            ReportPaths(
                *paths, str(tmp_path / "r"), str(tmp_path / "r.md"), [str(tmp_path / "gone.json")]
            )
        )


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
    run(ReportPaths(*paths, str(tmp_path / "r"), str(tmp_path / "r.md")))
    md = (tmp_path / "r.md").read_text()
    assert "- engine: static, CUDA graphs, compiled steps" in md
    assert "| target only | static | - | 1.000 | 1.00 | 10.0 | 1.00x vs target | - |" in md
    assert (
        "| DFlash drafter | static | 2.500 | 2.340 | 1.30 | 18.0 | 1.80x vs target | 1.000 |" in md
    )
    assert "| prompt lookup as configured | static | 1.900 | - | - | 18.0 | 1.30x vs target |" in md
    assert "| DDTree, 32 nodes | static | 3.100 | - | - | 18.0 | 1.95x vs target | 1.000 |" in md
    assert "![ddtree](r/ddtree.png)" in md
    assert "eager loop:" not in md
    assert mpimg.imread(tmp_path / "r" / "ddtree.png").shape[0] > 100


def test_an_unchecked_run_says_so(tmp_path):
    """evaluate.lossless_check: false leaves lossless_fraction null: the summary says it was not
    checked instead of printing a number."""
    inputs = _inputs(tmp_path)
    Path(inputs[1]).write_text(json.dumps(EVAL | {"lossless_fraction": None}))
    run(ReportPaths(*inputs, str(tmp_path / "plots"), str(tmp_path / "report.md")))
    md = (tmp_path / "report.md").read_text()
    assert "lossless fraction (float32): not checked (evaluate.lossless_check: false)" in md


def test_the_serving_lines_are_this_runs(tmp_path, monkeypatch):
    """The README's launch lines with this run's target, drafter directory and block size, and
    vLLM's num_speculative_tokens one less (it does not read block_size). A GGUF target's lines
    keep the drafter's own load format, which both engines would otherwise take from the GGUF
    (report.py's comment names the sources read); an HF directory's lines need no such flag."""
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
    run(ReportPaths(*paths, "results/report", "results/report.md"))
    md = (tmp_path / "results" / "report.md").read_text()
    serve = md[md.index("## Serve the drafter") :]
    assert f"python -m sglang.launch_server --model-path {target}" in serve
    assert "--speculative-algorithm DFLASH --speculative-draft-model-path results/drafter" in serve
    assert f"--speculative-num-draft-tokens 8 \\\n    {GGUF_FLAGS}\n" in serve
    assert GGUF_FLAGS == (
        "--speculative-draft-load-format auto --speculative-draft-model-quantization unquant"
    )
    assert (
        f'vllm serve {target} --speculative-config \'{{"method": "dflash", "model": '
        '"results/drafter", "num_speculative_tokens": 7, "draft_load_config": {"load_format": '
        '"auto"}}\'' in serve
    )
    assert "The target is a GGUF file." in serve and "Neither pairing was run here." in serve
    assert "VLLM_USE_V2_MODEL_RUNNER=1" in serve and "mask_embedding.pt" in serve
    hf = EVAL | info | {"target": "resources/smollm2"}  # an HF directory: the plain lines
    (tmp_path / "eval.json").write_text(json.dumps(hf))
    run(ReportPaths(*paths, "results/report", "results/report.md"))
    serve = (tmp_path / "results" / "report.md").read_text().split("## Serve the drafter")[1]
    assert "--speculative-num-draft-tokens 8\n```" in serve and "GGUF" not in serve
    assert '"num_speculative_tokens": 7}\'' in serve and "draft_load_config" not in serve
    (tmp_path / "eval.json").write_text(json.dumps(EVAL))  # metrics without a drafter record
    run(ReportPaths(*paths, "results/report", "results/report.md"))
    assert "Serve the drafter" not in (tmp_path / "results" / "report.md").read_text()


def test_a_dflash2_export_adds_its_notes_and_the_llama_cpp_lines(tmp_path, monkeypatch):
    """A DFlash2 export (architectures ["DFlash2DraftModel"], as export.py writes it) keeps the
    SGLang and vLLM lines of DFlash (both engines take it with the same flags and pick the
    architecture from config.json) and adds the llama.cpp lines: a GGUF of the drafter from its
    converter, which needs the target's HF directory, and --spec-draft-n-max one less than the
    block. A DFlash export prints neither (serving.py's comment names the sources read)."""
    monkeypatch.chdir(tmp_path)
    drafter = tmp_path / "results" / "drafter"
    drafter.mkdir(parents=True)
    paths = _inputs(tmp_path)
    info = {"drafter": {"path": "results/drafter", "block_size": 8}, "target": "resources/smollm2"}

    def served(architecture: str, target: str) -> str:
        config = {"architectures": [architecture], "block_size": 8}
        (drafter / "config.json").write_text(json.dumps(config))
        (tmp_path / "eval.json").write_text(json.dumps(EVAL | info | {"target": target}))
        run(ReportPaths(*paths, "results/report", "results/report.md"))
        return (tmp_path / "results" / "report.md").read_text().split("## Serve the drafter")[1]

    dflash = served("DFlashDraftModel", "resources/smollm2")
    dflash2 = served("DFlash2DraftModel", "resources/smollm2")
    assert dflash2.startswith(dflash.rstrip("\n"))  # DFlash's lines first, unchanged
    assert "DFlash2" not in dflash and "llama" not in dflash
    assert (
        "```\npython convert_hf_to_gguf.py results/drafter --outfile drafter.gguf "
        "--target-model-dir resources/smollm2\nllama-server -m <target GGUF> --spec-type "
        "draft-dflash --spec-draft-model drafter.gguf \\\n    --spec-draft-n-max 7\n```"
    ) in dflash2
    assert "`--spec-draft-n-max` = block size 8 - 1" in dflash2
    assert "registers `DFlashDraftModel` only, so this step is unverified" in dflash2
    assert "1 + `num_speculative_tokens`" in dflash2 and "unquantized target" in dflash2
    assert "its DFlash2 loader was not found in the source" in dflash2
    gguf = "resources/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    lines = served("DFlash2DraftModel", gguf)
    assert f"--speculative-num-draft-tokens 8 \\\n    {GGUF_FLAGS}\n" in lines
    assert "--target-model-dir <target HF directory>\n" in lines
    assert f"llama-server -m {gguf} --spec-type draft-dflash" in lines


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
    run(ReportPaths(*paths, str(tmp_path / "r"), str(tmp_path / "r.md")))
    md = (tmp_path / "r.md").read_text()
    assert "- engine: eager (why: below the methods table)" in md
    assert "| DFlash drafter | eager | 2.000 |" in md
    table_end = md.index("| DFlash drafter | eager")
    assert md.index(f"eager loop: {reason} (speedups of the eager loop") > table_end
    assert "DDTree needs the static engine: not run" in md


def _looked_up(configs: list[LookupConfig], prompts: list, outputs: list, decode_s: float):
    """Prompt lookup's responses with each prompt's configuration: replays (exact, decoding
    being greedy) with a decode time."""
    return [
        dataclasses.replace(
            replay(
                PromptLookupProposer(c.num_drafts, c.max_ngram_size, c.occurrence, c.search),
                ids,
                out,
                32,
                set(),
            ),
            prefill_s=0.01,
            decode_s=decode_s,
        )  # fmt: skip
        for c, (_, ids), out in zip(configs, prompts, outputs, strict=True)
    ]


def _evaluated(tmp_path) -> list[str]:
    """The report's inputs around metrics.json as evaluate writes it (decoding/summary.py's
    summarize, lookup's sweep over 48 configurations): four prompts of two sources, HumanEval-
    like answers copying runs of their prompt and ShareGPT-like ones repeating a phrase of their
    own, so each source has another best configuration and the figures differ: prompt lookup at
    its best 2.642, its one best configuration over all prompts 2.534, as configured 2.434."""
    rng = random.Random(3)
    prompts, outputs = [], []
    for k, source in enumerate(["humaneval", "sharegpt"] * 2):
        ids = [rng.randrange(50) for _ in range(30)]
        if source == "humaneval":
            out = []
            while len(out) < 32:
                start = rng.randrange(25)
                out += ids[start : start + rng.randrange(2, 6)]
        else:
            phrase = [rng.randrange(50) for _ in range(8)]
            out = [rng.randrange(50) for _ in range(2)] + phrase * 4
        prompts.append(({"prompt_id": f"p{k}", "source": source}, ids))
        outputs.append(out[:32])
    swept = sweep([ids for _, ids in prompts], outputs, 32, set())
    configured = LookupConfig()
    grid = {c.name: c for c in GRID}
    best = {"humaneval": grid["latest n<=1 k=5 prompt"], "sharegpt": grid["earliest n<=2 k=16 all"]}
    main = {
        "target": [Decoded(out, "length", 0.01, 1.0) for out in outputs],
        "dflash": [Decoded(out, "length", 0.01, 0.6, [2] * 15 + [1], [3] * 16) for out in outputs],
        "prompt_lookup": _looked_up([configured] * 4, prompts, outputs, 0.8),
        "prompt_lookup_best": _looked_up(
            [best[r["source"]] for r, _ in prompts], prompts, outputs, 0.7
        ),  # fmt: skip
    }
    engine = {"kind": "static", "graphs": False, "compiled": False}
    lossless = {m: main[m] for m in ("target", "dflash")}
    metrics = summarize(prompts, main, lossless, 4, configured, False, engine, swept)
    metrics |= {"num_prompts": 4, "skipped": {"prompt_too_long": 0, "template_error": 0},
                "settings": {"num_prompts": 4, "workers": 2}}  # fmt: skip
    paths = _inputs(tmp_path)
    Path(paths[1]).write_text(json.dumps(metrics))
    stats = {"sources": {"sharegpt": {"dropped": {"over_limit": 5000, "too_long": 40,
                                                  "truncated_tail": 1, "duplicate": 2}},
                         "humaneval": {"dropped": {"duplicate": 1}}},
             "totals": {"train": 96, "eval": 186, "dropped": {"over_limit": 5000, "too_long": 40,
                                                              "truncated_tail": 1, "duplicate": 3}}}  # fmt: skip
    Path(paths[2]).write_text(json.dumps(stats))
    return paths


def test_every_prompt_lookup_tau_is_named_and_the_figures_agree(tmp_path):
    """Issue 60: the summary called the one configuration best over all prompts (2.534 here)
    "prompt lookup at its best" while the table's row said tau for the configured one (2.434),
    and a label such as `earliest n<=2 k=10 all` was never explained. Now at its best means each
    source's best configuration everywhere: the table's figures pooled over its prompts, the
    decoded row and the speedup; the other two figures are named, and the labels read once."""
    paths = _evaluated(tmp_path)
    run(ReportPaths(*paths, str(tmp_path / "r"), str(tmp_path / "r.md")))
    md = (tmp_path / "r.md").read_text()
    table = [line.split(" | ") for line in md.splitlines() if line.startswith("| humaneval |")
             or line.startswith("| sharegpt |")]  # fmt: skip
    assert [(row[0], row[1], row[4]) for row in table] == [
        ("| humaneval", "2", "`latest n<=1 k=5 prompt`"),
        ("| sharegpt", "2", "`earliest n<=2 k=16 all`"),
    ]
    pooled = sum(int(row[1]) * float(row[3]) for row in table) / 4
    assert round(pooled, 3) == 2.642
    assert ("prompt lookup's: **2.642** at its best (each source's best configuration: the "
            "table's, over all its prompts); 2.534 for the one configuration best over all prompts "
            "(`earliest n<=2 k=16 all`); 2.434 as configured (`earliest n<=2 k=10 all`)") in md  # fmt: skip
    assert "| prompt lookup as configured `earliest n<=2 k=10 all` | static | 2.434 |" in md
    assert "| prompt lookup at its best (each source's best configuration) | static | 2.642 |" in md
    assert (
        "prompt lookup's: **1.43x** at its best (each source's best configuration); 1.25x as" in md
    )
    assert "(timed)" not in md
    assert md.count("A prompt-lookup configuration is named `occurrence n<=N k=K search`") == 1
    assert f"evaluate replays {len(GRID)} of them (N 1-4, K 5, 10, 16)" in md
    assert "With evaluate.workers 2, each worker process picks its sources' best" in md


def test_the_prompt_counts_say_what_evaluate_decoded(tmp_path):
    """Issue 60: "96 train, 186 eval" prompts beside an evaluation of "8 prompts". The data line
    and the evaluation's heading say evaluate decodes the first evaluate.num_prompts of the
    held-out prompts, the table how many of each source; skipped ones are counted."""
    paths = _evaluated(tmp_path)
    run(ReportPaths(*paths, str(tmp_path / "r"), str(tmp_path / "r.md")))
    md = (tmp_path / "r.md").read_text()
    assert ("- prompts: 96 train, 186 held out for evaluation (evaluate decoded 4 of them: the "
            "first evaluate.num_prompts (4), taken round robin over the sources); ") in md  # fmt: skip
    assert "## Evaluation (4 of the 186 held-out prompts, " in md
    assert "| source | prompts | DFlash tau |" in md and "| sharegpt | 2 | " in md
    metrics = json.loads(Path(paths[1]).read_text())
    metrics["settings"]["num_prompts"] = 5
    metrics["skipped"]["prompt_too_long"] = 1
    Path(paths[1]).write_text(json.dumps(metrics))
    run(ReportPaths(*paths, str(tmp_path / "r"), str(tmp_path / "r.md")))
    assert ("evaluate decoded 4 of them: the first evaluate.num_prompts (5), taken round robin "
            "over the sources, less 1 too long for the context or refused by the chat template"
            ) in (tmp_path / "r.md").read_text()  # fmt: skip


def test_each_drop_count_says_what_it_counts(tmp_path):
    """Issue 60: `dropped {'over_limit': ..., 'too_long': ...}` unexplained. Each reason gets a
    line with what one count of it is, from sources.DROP_REASONS, and each source's share."""
    paths = _evaluated(tmp_path)
    run(ReportPaths(*paths, str(tmp_path / "r"), str(tmp_path / "r.md")))
    md = (tmp_path / "r.md").read_text()
    assert "left out by the prompts stage, a count per reason:\n  - `over_limit` 5,000: " in md
    for reason, count in (("over_limit", "5,000"), ("too_long", "40"), ("truncated_tail", "1"),
                          ("duplicate", "3 (sharegpt 2, humaneval 1)")):  # fmt: skip
        assert f"  - `{reason}` {count}: {DROP_REASONS[reason]}\n" in md
    assert "prompts.max_train" in DROP_REASONS["over_limit"]
    assert "prompts.max_chars" in DROP_REASONS["too_long"]


def _reasons_given(path: Path) -> set[str]:
    """The drop reasons a module's code names: drop(...) and BadConversation(...)'s first
    argument, `[...]["dropped"]["reason"]`, `reason = ...` and passes_filters' returns."""

    def strings(node) -> set[str]:
        return {n.value for n in ast.walk(node)
                if isinstance(n, ast.Constant) and isinstance(n.value, str)}  # fmt: skip

    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and node.args:
            if getattr(node.func, "attr", getattr(node.func, "id", None)) in (
                "drop", "BadConversation"
            ):  # fmt: skip
                found |= strings(node.args[0])
        elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Subscript):
            if getattr(node.value.slice, "value", None) == "dropped":
                found |= strings(node.slice)
        elif isinstance(node, ast.Assign) and [getattr(t, "id", "") for t in node.targets] == [
            "reason"
        ]:  # fmt: skip
            found |= strings(node.value)
        elif isinstance(node, ast.FunctionDef) and node.name == "passes_filters":
            found |= {v for r in ast.walk(node) if isinstance(r, ast.Return) and r.value
                      for v in strings(r.value)}  # fmt: skip
    return found


def test_every_drop_reason_the_code_gives_has_its_explanation():
    """A reason the prompts stage's code names but sources.DROP_REASONS lacks would reach the
    report unexplained: the code's reasons are the table's keys, and a DropLog refuses one
    that is not declared (a count would otherwise land in stats.json first)."""
    src = Path(dflashpipe.__file__).parent
    given = _reasons_given(src / "sources.py") | _reasons_given(src / "prompts.py")
    assert given == set(DROP_REASONS) and len(given) > 20
    assert all(DROP_REASONS.values())
    drops = DropLog()
    drops.drop("too_long", "a.jsonl:3", "turn 0")
    drops.counts["over_limit"] += 2
    assert drops.counts == {"too_long": 1, "over_limit": 2}
    with pytest.raises(KeyError, match="'too_big' is not in sources.DROP_REASONS"):
        drops.drop("too_big", "a.jsonl:4")


def test_the_report_stage_never_imports_torch():
    """The report job reads JSON and draws plots: importing torch cost it 1.4 s of its 2 s
    start (decoding/lookup's grid pulled it in through decoding/types)."""
    import subprocess
    import sys

    code = (
        "import sys, dflashpipe.report, dflashpipe.decoding.lookup; print('torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False", done.stderr[-2000:]
