"""benchmarks/quality.py, the quality benchmark's driver, on the CPU with tiny sizes: the recipe
(configs/smollm2-sharegpt.yaml: its retrieved ShareGPT, HumanEval and code wheels, its stages and
overlays) runs end to end on the tiny target (SmolLM2's tokenizer, 3 layers: the driver is under
test, not the model; the real SmolLM2 runs in test_workflow), a variant reuses the main run's
finished stages instead of redoing them, and the summary table reports both."""

import errno
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
from fnmatch import fnmatch
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from conftest import REPO, worker_cores, write_yaml

from dflashpipe.stages import digest

TINY = {
    "prompts": {"max_train": 8},
    "regenerate": {"shards": 1, "batch_size": 4, "max_new_tokens": 8, "save_every": 4},
    "extract": {"max_length": 512, "token_budget": 4096},
    "drafter": {"num_layers": 1, "target_layer_ids": [0, 1]},  # the tiny target has 3 layers
    "train": {"max_steps": 2, "micro_batch_tokens": 512, "num_anchors": 32, "tokens_per_step": None,
              "log_every": 1, "num_workers": 1, "val_samples": 2},
    "evaluate": {"num_prompts": 2, "max_new_tokens": 8, "workers": 1, "tree_nodes": [4]},
}  # fmt: skip


def extra_samples(work):
    """How many samples a run's training took from train.extra_features (its train log)."""
    log = (work / "results" / "logs" / "train.log").read_text()
    return int(log.split("samples (")[1].split(" of them from train.extra_features")[0])


def _load_quality():
    """benchmarks/quality.py as a module (it is a script, not part of the package)."""
    spec = importlib.util.spec_from_file_location("quality", REPO / "benchmarks" / "quality.py")
    quality = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(quality)
    return quality


@pytest.mark.slow
def test_quality_driver_main_and_variants(tmp_path, smollm2_dir, tiny_target_dir):
    tiny = write_yaml(
        tmp_path / "tiny.yaml",
        {"target": {"model": str(tiny_target_dir), "gguf_file": None}, **TINY},
    )
    runs = tmp_path / "runs"
    cmd = [sys.executable, str(REPO / "benchmarks" / "quality.py"), "main", "stdlib-answers",
           "stdlib-extra", "--runs", str(runs), "--configfile", str(tiny),
           "--cores", str(worker_cores()), "--out", str(tmp_path / "rows.json"),
           "--bundle", str(tmp_path / "logs.tar.gz")]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    main, cell = runs / "quality-main" / "results", runs / "quality-stdlib-extra" / "results"
    # the variant shares the main run's answers and features (hard links) and made neither
    seq = "sequences/shard-00000.parquet"
    assert (main / seq).stat().st_ino == (cell / seq).stat().st_ino
    shard = "features/shard-00000.arrow"
    assert (main / shard).stat().st_ino == (cell / shard).stat().st_ino
    assert not (cell / "logs" / "regenerate").exists() and not (cell / "logs" / "extract").exists()
    assert (main / "logs" / "regenerate" / "shard-00000.log").exists()
    manifest = json.loads((main / "features" / "manifest.json").read_text())
    assert manifest["codec"] == "fp8-zstd"  # the recipe's, under the tiny overrides
    rows = {r["variant"]: r for r in json.loads((tmp_path / "rows.json").read_text())}
    # dataset-features, mixed and the codec cell bf16 are the same mechanisms (regenerate off;
    # reuse + wait + train.extra_features; an overlay's section) as this run's: left out for the
    # suite's time.
    assert set(rows) == {"main", "stdlib-extra"}
    # the recipe's code prompts: the retrieved wheels' functions, beside ShareGPT's
    sources = json.loads((main / "prompts" / "stats.json").read_text())["sources"]
    assert {n for n, s in sources.items() if s["kind"] == "python" and s["added"] > 0} == {
        "sympy", "networkx", "pydash", "boltons", "more-itertools"}  # fmt: skip
    # stdlib-answers: prompts from the interpreter's standard library, regenerated, stopped at
    # extract; stdlib-extra trains on them beside main's features
    std = runs / "quality-stdlib-answers" / "results"
    sources = json.loads((std / "prompts" / "stats.json").read_text())["sources"]
    assert set(sources) == {"stdlib"} and sources["stdlib"]["train"] > 0
    assert (std / "features" / "manifest.json").is_file() and not (std / "drafter").exists()
    extra = extra_samples(runs / "quality-stdlib-extra")
    std_samples = json.loads((std / "features" / "manifest.json").read_text())["totals"]
    assert extra == std_samples["samples"] > 0
    # the data's size: the tokens train counted (its own less the held-out answers', plus all of
    # the extra features')
    own = json.loads((main / "features" / "manifest.json").read_text())["totals"]["tokens"]
    trained = json.loads((main / "train" / "metrics.jsonl").read_text().splitlines()[-1])
    assert rows["main"]["train_tokens"] == trained["train_tokens"] < own
    assert rows["stdlib-extra"]["train_tokens"] == trained["train_tokens"] + std_samples["tokens"]
    report = (runs / "quality-stdlib-extra" / "results" / "report.md").read_text()
    assert (
        "- train.extra_features ../quality-stdlib-answers/results/features/manifest.json: "
        in report
    )
    for r in rows.values():
        assert set(r["tau"]) == {"sharegpt", "humaneval"} and r["bytes_per_token"] > 0
        assert r["ddtree_nodes"] == "4" and r["ddtree_tau"] >= 1 and r["ddtree_speedup"] > 0
    r = rows["main"]
    assert r["lossless"] == 1.0 and set(r["lookup_tau"]) == {"sharegpt", "humaneval"}
    assert r["ahead"] and all(sum(c.values()) > 0 for c in r["ahead"].values())
    # a lever cell (`# also: tau-only`): no float32 pass, no prompt lookup, its row still made
    assert rows["stdlib-extra"]["lossless"] is None and rows["stdlib-extra"]["lookup_tau"] == {}
    assert "| stdlib-extra |" in done.stdout and "| main |" in done.stdout
    assert "| ahead of lookup humaneval | ahead of lookup sharegpt |" in done.stdout
    assert "| ddtree nodes | ddtree tau | ddtree speedup |" in done.stdout
    assert "extract/shard-00000" in done.stdout  # per-job times from the benchmark files
    with tarfile.open(tmp_path / "logs.tar.gz") as tar:  # the small files, no shards or weights
        names = set(tar.getnames())
    for run in ("quality-main", "quality-stdlib-extra"):
        assert {f"{run}/eval/metrics.json", f"{run}/train/metrics.jsonl", f"{run}/report.md",
                f"{run}/logs/evaluate.log", f"{run}/quality.log"} <= names  # fmt: skip
    assert not [n for n in names if n.endswith((".arrow", ".parquet", ".safetensors", ".pt"))]

    # Kept answers: main's prompts and sequences in parts, restored into a fresh run that then
    # starts after regenerate; refused when damaged or made with another regenerate section.
    kept = tmp_path / "kept"
    plot = tmp_path / "scaling.png"
    keep = [sys.executable, str(REPO / "benchmarks" / "quality.py"), "main", "--runs", str(runs),
            "--table", "--keep", str(kept), "--plot", str(plot)]  # fmt: skip
    assert subprocess.run(keep, capture_output=True, text=True, timeout=300).returncode == 0
    assert plot.read_bytes()[:4] == b"\x89PNG"  # tau against the tokens trained on
    parts = sorted(kept.glob("answers-main-*.part-*"))
    assert parts, sorted(kept.iterdir())
    fresh = tmp_path / "fresh"

    def restored_run(runs_dir, kept_dir):  # main on another machine, from answers kept there
        return [sys.executable, str(REPO / "benchmarks" / "quality.py"), "main", "--runs",
                str(runs_dir), "--configfile", str(tiny), "--restore", str(kept_dir), "--target",
                "regenerate"]  # fmt: skip

    again = restored_run(fresh, kept)
    done = subprocess.run(again, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "restore:" in done.stdout and "kept answers into" in done.stdout
    restored = fresh / "quality-main" / "results"
    assert (restored / seq).read_bytes() == (main / seq).read_bytes()
    assert not (restored / "logs" / "regenerate").exists()  # nothing regenerated
    assert not (restored / "logs" / "prompts.log").exists()
    quality = _load_quality()
    configs = [str(p) for p in (quality.RECIPE, tiny)]
    other = write_yaml(tmp_path / "seed.yaml", {"regenerate": {"seed": 12345}})
    assert not quality.restore(tmp_path / "other", "main", kept, [*configs, str(other)])
    assert not (tmp_path / "other" / "quality-main" / "results" / "sequences").exists()
    damaged = tmp_path / "damaged"
    shutil.copytree(kept, damaged)
    part = sorted(damaged.iterdir())[-1]
    part.write_bytes(part.read_bytes()[:-1])
    assert not quality.restore(tmp_path / "third", "main", damaged, configs)
    assert quality.restore(tmp_path / "fourth", "main", kept, configs)  # the same config: restored

    # A shard cut short on one machine finishes on another: its part files travel with the kept
    # answers, and the next machine regenerates only the answers they lack.
    (restored / seq).unlink()
    # at the last of its 5 answers (6 prompts, one too long): of its two parts (answers 0-3 and
    # 4) the one without that answer is whole and saved, the other is not
    kill = {**os.environ, "DFLASHPIPE_KILL_AT": "regenerate.answer:5"}
    cut = subprocess.run(again, capture_output=True, text=True, timeout=600, env=kill)
    assert cut.returncode != 0 and not (restored / seq).exists()
    assert len(list((restored / "sequences").glob(".shard-00000.parquet.parts/part-*"))) == 1
    quality.keep(fresh, ["main"], tmp_path / "kept-cut")
    other = tmp_path / "other-machine"
    done = subprocess.run(
        restored_run(other, tmp_path / "kept-cut"), capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    finished = other / "quality-main" / "results"
    assert pq.read_table(finished / seq).to_pylist() == pq.read_table(main / seq).to_pylist()
    log = (finished / "logs" / "regenerate" / "shard-00000.log").read_text()
    assert log.count(" saved (") == 1  # the other part came from the kept answers


def test_a_run_trained_but_not_evaluated_has_a_row_of_training_figures(tmp_path):
    """`--target train` (or a run cut short): the table shows its held-out expected tau."""
    quality = _load_quality()
    work = tmp_path / "quality-block8"
    assert quality.row(work) is None  # nothing trained yet
    (work / "results" / "drafter").mkdir(parents=True)
    (work / "results" / "drafter" / "model.safetensors").write_bytes(b"")
    (work / "results" / "train").mkdir()
    rows = [{"step": 5, "expected_acceptance": 1.5}, {"step": 9, "expected_acceptance": 2.4,
            "val_expected_acceptance": 1.94}]  # fmt: skip
    (work / "results" / "train" / "metrics.jsonl").write_text("\n".join(map(json.dumps, rows)))
    r = quality.row(work)
    assert r["variant"] == "block8" and r["tau_all"] is None and r["lossless"] is None
    assert (r["expected_tau"], r["held_out_expected_tau"], r["steps"]) == (2.4, 1.94, 9)
    line = quality.table([r]).splitlines()[-1]
    assert line.startswith("| block8 | - |") and "| 1.940 | - | 9 |" in line  # no chain yet
    # a DFlash2 run's chain figure is its selector's walk, else the unary chain
    rows[-1] |= {"val_chain_acceptance": 2.1, "val_selector_chain_acceptance": 2.3}
    (work / "results" / "train" / "metrics.jsonl").write_text("\n".join(map(json.dumps, rows)))
    assert quality.row(work)["held_out_chain_tau"] == 2.3
    del rows[-1]["val_selector_chain_acceptance"]
    (work / "results" / "train" / "metrics.jsonl").write_text("\n".join(map(json.dumps, rows)))
    assert "| 1.940 | 2.100 | 9 |" in quality.table([quality.row(work)])


def test_a_tau_only_evaluate_has_a_row_without_prompt_lookup(tmp_path):
    """The lever cells evaluate without prompt lookup (tau-only: `baseline` is empty): their row
    has the drafter's figures and "-" for the lookup's, instead of failing the whole table (as it
    did on the H200 on 2026-12-04, after the cells had finished)."""
    quality = _load_quality()
    work = tmp_path / "quality-betas999"
    (work / "results" / "eval").mkdir(parents=True)
    metrics = {"acceptance_length": 2.46, "per_source": {"humaneval": 2.60, "sharegpt": 2.33},
               "speedup": 2.2, "lossless_fraction": None, "bf16_agreement": 1.0, "baseline": {},
               "ddtree": {"16": {"acceptance_length": 3.19, "speedup": 2.9},
                          "32": {"acceptance_length": 3.39, "speedup": 2.7}},
               "num_prompts": 128}  # fmt: skip
    (work / "results" / "eval" / "metrics.json").write_text(json.dumps(metrics))
    r = quality.row(work)
    assert (r["tau_all"], r["tau"]["sharegpt"]) == (2.46, 2.33)
    assert (r["lookup_all"], r["lookup_tau"]) == (None, {})
    assert (r["ddtree_nodes"], r["ddtree_tau"]) == ("16", 3.19)
    line = quality.table([r]).splitlines()[-1]
    assert line.startswith("| betas999 | 2.600 | 2.330 | - | - | - | - | 2.460 | - |")


def test_a_variant_listed_before_the_run_it_reads_fails_before_anything_runs(tmp_path):
    """`stdlib-extra` trains on stdlib-answers' features (its `# wait:` line): listing it first,
    or alone with no such run, stops at once with the order to use; listed after it, the check
    passes."""
    quality = _load_quality()
    runs = tmp_path / "runs"
    for variants in (["main", "stdlib-extra", "stdlib-answers"], ["stdlib-extra"]):
        with pytest.raises(SystemExit, match="list stdlib-answers before it"):
            quality.check_order(runs, variants)
    assert not runs.exists()  # nothing was prepared
    quality.check_order(runs, ["main", "stdlib-answers", "stdlib-extra"])
    made = runs / "quality-stdlib-answers" / "results" / "features" / "manifest.json"
    made.parent.mkdir(parents=True)
    made.write_text("{}")
    quality.check_order(runs, ["stdlib-extra"])  # the run it reads exists already


def test_every_overlay_is_a_valid_config_on_the_recipe():
    """Each variant's config (the recipe, then its overlay merged in, as Snakemake merges
    --configfile) passes the schema and the config checks: a typo in an overlay fails here, not
    after a GPU run's regenerate."""
    import yaml

    from dflashpipe.config import Config

    quality = _load_quality()
    overlays = sorted((REPO / "benchmarks" / "quality").glob("*.yaml"))
    assert len(overlays) >= 10
    assert quality.recipe("gemma3") == REPO / "configs" / "gemma3-270m-quality.yaml"
    assert quality.recipe("bf16") == quality.RECIPE
    for path in overlays:
        recipe = yaml.safe_load(quality.recipe(path.stem).read_text())
        over = yaml.safe_load(path.read_text()) or {}
        stacked = quality.merged_configs([str(p) for p in quality.stack(path.stem)])
        cfg = Config.from_dict(quality.merged(recipe, stacked))
        for section, values in over.items():
            for key, value in values.items():
                nested = isinstance(value, dict) or (
                    isinstance(value, list) and any(isinstance(v, dict) for v in value)
                )  # sections and sources get their defaults filled in
                if not nested:
                    assert cfg.raw[section][key] == value, (path.name, section, key)


def test_the_concurrency_cell_is_the_recipe_at_four_loads():
    """benchmarks/remote/concurrency.yaml on the recipe (what concurrency.sh merges): a valid
    config that decodes the server's methods at 1, 4, 16 and 64 rows, the recipe's prompts and
    lengths unchanged."""
    from dflashpipe.config import Config

    quality = _load_quality()
    cell = REPO / "benchmarks" / "remote" / "concurrency.yaml"
    cfg = Config.from_dict(quality.merged_configs([str(quality.RECIPE), str(cell)]))
    recipe = Config.from_dict(quality.merged_configs([str(quality.RECIPE)]))
    assert cfg.evaluate.concurrency == [1, 4, 16, 64]
    assert cfg.evaluate.methods == recipe.evaluate.methods
    assert "prompt_lookup" in cfg.evaluate.methods  # the load levels decode it too
    assert cfg.evaluate.lossless_check is False
    for key in ("num_prompts", "max_new_tokens", "prompt_lookup_num_tokens", "tree_nodes"):
        assert getattr(cfg.evaluate, key) == getattr(recipe.evaluate, key), key
    assert "concurrency.yaml" in (REPO / "benchmarks" / "remote" / "concurrency.sh").read_text()
    # the cut cell: the same loads and prompts, target-only and DFlash only
    cut = REPO / "benchmarks" / "remote" / "concurrency-dflash.yaml"
    small = Config.from_dict(quality.merged_configs([str(quality.RECIPE), str(cut)]))
    assert (small.evaluate.concurrency, small.evaluate.methods) == (
        [1, 4, 16, 64],
        ["target", "dflash"],
    )
    assert small.evaluate.num_prompts == recipe.evaluate.num_prompts
    # its A/B: the same cut cell with the refills apart
    apart = REPO / "benchmarks" / "remote" / "concurrency-pack.yaml"
    ab = Config.from_dict(quality.merged_configs([str(quality.RECIPE), str(cut), str(apart)]))
    assert (small.evaluate.concurrency_refill, ab.evaluate.concurrency_refill) == ("step", "pack")
    assert {**ab.raw["evaluate"], "concurrency_refill": "step"} == small.raw["evaluate"]


def test_the_4x_cell_with_the_concurrency_cell_on_top_evaluates_every_method_at_load(tmp_path):
    """bg.sh's QUALITY_EXTRA="fp4.yaml concurrency.yaml" on x4 (docs/quality.md, next GPU
    session item 1): x4's data in fp4-zstd, and its evaluate the concurrency cell, with prompt
    lookup and DDTree back over tau-only's methods."""
    from dflashpipe.config import Config

    quality = _load_quality()
    extra = [REPO / "benchmarks" / "quality" / "fp4.yaml", REPO / "benchmarks" / "remote" /
             "concurrency.yaml"]  # fmt: skip
    runs = tmp_path / "runs"
    for name in ("prompts", "sequences", "features"):  # x4 reuses main's
        (runs / "quality-main" / "results" / name).mkdir(parents=True)
    _, configs = quality.prepare(runs, "x4", [str(p) for p in extra])
    assert [Path(c).stem for c in configs] == ["smollm2-sharegpt", "tau-only", "x4", "fp4",
                                               "concurrency"]  # fmt: skip
    cfg = Config.from_dict(quality.merged_configs(configs))
    assert cfg.extract.codec == "fp4-zstd" and cfg.train.epochs == 3
    assert len(cfg.train.extra_features) == 2
    assert cfg.evaluate.concurrency == [1, 4, 16, 64] and not cfg.evaluate.lossless_check
    assert set(cfg.evaluate.methods) == {"target", "dflash", "prompt_lookup", "ddtree"}
    assert cfg.evaluate.tree_nodes == [16, 32]
    # x4-epochs6: x4's data and everything else, twice the epochs
    _, more = quality.prepare(runs, "x4-epochs6", [str(p) for p in extra])
    assert [Path(c).stem for c in more] == ["smollm2-sharegpt", "tau-only", "x4", "x4-epochs6",
                                            "fp4", "concurrency"]  # fmt: skip
    longer = quality.merged_configs(more)
    assert longer["train"].pop("epochs") == 6 and cfg.train.epochs == 3
    shorter = quality.merged_configs(configs)
    shorter["train"].pop("epochs")
    assert longer == shorter


def test_pack_sh_puts_kept_answers_in_the_fewest_carries(tmp_path):
    """`pack.sh answers DIR`: the 4x point's 9 parts (115 MB) in two folders, each of which
    fits one carry beside the working tree (64 MiB), every part once."""
    kept = tmp_path / "kept"
    kept.mkdir()
    sizes = {"main": [15_000_000] * 2 + [4_995_468], "sampled-answers": [15_000_000] * 2 +
             [6_612_312], "x4-sampled-b": [15_000_000] * 2 + [13_512_496]}  # fmt: skip
    for run, parts in sizes.items():
        for i, size in enumerate(parts):
            with open(kept / f"answers-{run}-0123456789abcdef.part-{i:02d}", "wb") as f:
                f.truncate(size)  # sparse: the sizes are what is packed
    out = tmp_path / "remote"
    env = {**os.environ, "PACK_OUT": str(out)}
    subprocess.run(["bash", "benchmarks/remote/pack.sh", "answers", str(kept)], cwd=REPO,
                   env=env, check=True, capture_output=True)  # fmt: skip
    folders = sorted(out.glob("k*"))
    assert [f.name for f in folders] == ["k1", "k2"]
    tree = _carried_bytes(REPO)
    for folder in folders:
        assert sum(f.stat().st_size for f in folder.iterdir()) + tree <= 64 * 2**20
    packed = sorted(f.name for folder in folders for f in folder.iterdir())
    assert packed == sorted(f.name for f in kept.iterdir())


def _carried_bytes(root: Path) -> int:
    """What a device call carries beside a part: git's tracked and untracked-not-ignored files
    in a checkout; in a source tree without .git, every file but those under a name or glob
    .gitignore lists (pack.sh's measure, computed apart from it)."""
    if (root / ".git").exists():
        listed = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"],
                                cwd=root, capture_output=True, check=True).stdout  # fmt: skip
        files = [root / name for name in listed.decode().split("\0") if name]
        return sum(f.lstat().st_size for f in files if f.is_file() or f.is_symlink())
    lines = (root / ".gitignore").read_text().splitlines()
    ignored = [line.rstrip("/") for line in lines if line.strip() and not line.startswith("#")]
    total = 0
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d != ".git" and not any(fnmatch(d, i) for i in ignored)]
        kept = [n for n in names if not any(fnmatch(n, i) for i in ignored)]
        total += sum((Path(folder) / n).lstat().st_size for n in kept)
    return total


def test_pack_sh_measures_a_source_tree_without_git(tmp_path):
    """A `git archive` tree (a source tarball) has no .git: `pack.sh answers` measured the tree
    with `git ls-files` and failed (exit 128, issue 60). It now counts every file but those
    .gitignore names: results/ and .venv/ here would leave no room at all, and the 10 MB of
    source decide the packing (without them the three parts would share one carry)."""
    tree = tmp_path / "tree"
    (tree / "benchmarks" / "remote").mkdir(parents=True)
    shutil.copy(REPO / "benchmarks" / "remote" / "pack.sh", tree / "benchmarks" / "remote")
    shutil.copy(REPO / ".gitignore", tree)
    sizes = {"src/model.bin": 10_000_000, "results/features.bin": 60_000_000,
             ".venv/torch.so": 60_000_000, "src/__pycache__/model.pyc": 60_000_000}  # fmt: skip
    for name, size in sizes.items():
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        with open(tree / name, "wb") as f:
            f.truncate(size)  # sparse: du -b counts the size
    kept = tmp_path / "kept"
    kept.mkdir()
    for i, size in enumerate([30_000_000, 30_000_000, 5_000_000]):
        with open(kept / f"answers-main-0123456789abcdef.part-{i:02d}", "wb") as f:
            f.truncate(size)
    out = tmp_path / "remote"
    done = subprocess.run(["bash", "benchmarks/remote/pack.sh", "answers", str(kept)], cwd=tree,
                          env={**os.environ, "PACK_OUT": str(out)}, capture_output=True,
                          text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr
    carried = _carried_bytes(tree)
    assert 10_000_000 < carried < 10_100_000
    packed = {f.name: sorted(p.name[-2:] for p in f.iterdir()) for f in out.glob("k*")}
    assert packed == {"k1": ["00", "02"], "k2": ["01"]}  # 30 + 5 MB and 30 MB beside 10 MB
    (tree / ".gitignore").write_text("results/\n!results/keep\n")
    done = subprocess.run(["bash", "benchmarks/remote/pack.sh", "answers", str(kept)], cwd=tree,
                          env={**os.environ, "PACK_OUT": str(out)}, capture_output=True,
                          text=True)  # fmt: skip
    assert done.returncode != 0 and "'!results/keep' needs git" in done.stderr


def test_a_lever_cell_stacks_a_tau_only_evaluate_under_its_change():
    """`# also: tau-only`: the recipe under the lever's own change, and an evaluate without the
    float32 pass; the stack is merged in order, each file once."""
    from dflashpipe.config import Config

    quality = _load_quality()
    assert [p.stem for p in quality.stack("rank8")] == ["tau-only", "rank8"]
    assert [p.stem for p in quality.stack("stdlib-extra")] == ["tau-only", "stdlib-extra"]
    recipe = Config.from_dict(quality.merged_configs([str(quality.RECIPE)])).raw["train"]
    for cell in ("rank8", "stdlib-extra"):
        configs = [str(quality.RECIPE)] + [str(p) for p in quality.stack(cell)]
        cfg = Config.from_dict(quality.merged_configs(configs))
        train, ev = cfg.raw["train"], cfg.raw["evaluate"]
        assert ev["lossless_check"] is False and ev["methods"] == ["target", "dflash", "ddtree"]
        assert (train["num_anchors"], train["epochs"]) == (recipe["num_anchors"], recipe["epochs"])
        assert train["rank_weight"] == (0.2 if cell == "rank8" else recipe["rank_weight"])
    assert train["extra_features"] == ["../quality-stdlib-answers/results/features/manifest.json"]
    assert quality.stack("main") == []


def test_a_run_links_the_resources_the_repo_link_points_to(tmp_path, monkeypatch):
    # On the GPU machine the repo's resources/ is a link to /tmp/res that a later call's copy of
    # the working tree removes: a run's own link must not go through it (it did: a variant
    # started after that failed with "No such file or directory: 'resources/smollm2'").
    quality = _load_quality()
    repo, res = tmp_path / "repo", tmp_path / "res"
    (res / "smollm2").mkdir(parents=True)
    repo.mkdir()
    (repo / "resources").symlink_to(res)
    monkeypatch.setattr(quality, "REPO", repo)
    runs = tmp_path / "runs"
    (runs / "quality-main" / "results" / "prompts").mkdir(parents=True)
    (runs / "quality-main" / "results" / "sequences").mkdir()
    (runs / "quality-bf16").mkdir()
    (runs / "quality-bf16" / "resources").symlink_to(tmp_path / "gone")  # dangling, replaced
    work, _ = quality.prepare(runs, "bf16", [])
    (repo / "resources").unlink()
    assert (work / "resources" / "smollm2").is_dir()
    assert (work / "results" / "sequences").is_dir()  # main's reused folders came along
    # a run prepared once the repo's link is gone (a background job after a later call's copy
    # of the working tree: the hf-engine run of 2026-12-05) links the folder setup.sh names
    (runs / "quality-hf-engine").mkdir()
    with pytest.raises(SystemExit, match="resources folder"):
        quality.prepare(runs, "hf-engine", [])
    monkeypatch.setenv("QUALITY_RESOURCES", str(res))
    work, _ = quality.prepare(runs, "hf-engine", [])
    assert (work / "resources" / "smollm2").is_dir()


def test_a_variant_reuses_the_results_of_the_run_its_from_line_names(tmp_path):
    """quarter-x2 and quarter-x1 (`# from: quarter-x4`) train on quarter-x4's prompts, answers
    and features under its config: listed before it (or without it) they stop at once; their
    folders are hard links to quarter-x4's, not main's; their config is quarter-x4's plus
    train.answers_per_prompt."""
    from dflashpipe.config import Config

    quality = _load_quality()
    runs = tmp_path / "runs"
    for variants in (["main", "quarter-x2", "quarter-x4"], ["quarter-x1"]):
        with pytest.raises(
            SystemExit, match=r"reuses quarter-x4's results.*list quarter-x4 before"
        ):
            quality.check_order(runs, variants)
    quality.check_order(runs, ["main", "quarter-x4", "quarter-x2", "quarter-x1"])
    for run in ("main", "quarter-x4"):
        for name in ("prompts", "sequences", "features"):
            (runs / f"quality-{run}" / "results" / name).mkdir(parents=True)
            (runs / f"quality-{run}" / "results" / name / "made-by").write_text(run)
    quality.check_order(runs, ["quarter-x1"])  # the run it reads exists already
    work, configs = quality.prepare(runs, "quarter-x1", [])
    made = work / "results" / "features" / "made-by"
    own = runs / "quality-quarter-x4" / "results" / "features" / "made-by"
    assert made.read_text() == "quarter-x4" and made.stat().st_ino == own.stat().st_ino
    assert [p.stem for p in quality.stack("quarter-x2")] == ["tau-only", "quarter-x4", "quarter-x2"]
    cfg = Config.from_dict(quality.merged_configs(configs))
    assert cfg.train.answers_per_prompt == 1 and cfg.regenerate.samples_per_prompt == 4
    x4 = [str(quality.RECIPE)] + [str(p) for p in quality.stack("quarter-x4")]
    x4_cfg = Config.from_dict(quality.merged_configs(x4))
    for stage in ("prompts", "regenerate", "extract"):  # what made the reused folders
        assert digest(cfg, stage) == digest(x4_cfg, stage)
    recipe = Config.from_dict(quality.merged_configs([str(quality.RECIPE)]))
    limits = {s.name: s.limit for s in cfg.prompts.sources}
    assert limits["sharegpt"] == 6057 and limits["humaneval"] is None
    # the sources are the recipe's but for their limits, so the eval prompts are the recipe's
    strip = [{**s.__dict__, "limit": None} for s in cfg.prompts.sources]
    assert strip == [s.__dict__ for s in recipe.prompts.sources]


def test_a_run_on_another_file_system_copies_the_reused_folders_with_their_mtimes(
    tmp_path, monkeypatch
):
    # x4-sampled-b's run directory is a link to a RAM disk: hard links to main's prompts fail
    # there with EXDEV (the GPU machine, 2026-12-06), and the half-made folder then looked done
    quality = _load_quality()
    runs = tmp_path / "runs"
    prompts = runs / "quality-main" / "results" / "prompts"
    prompts.mkdir(parents=True)
    (prompts / "train.parquet").write_bytes(b"rows")
    os.utime(prompts / "train.parquet", (1_000_000, 1_000_000))
    (runs / "quality-x4-sampled-b" / "results" / "prompts.part").mkdir(parents=True)
    (runs / "quality-x4-sampled-b" / "results" / "prompts.part" / "stale").write_text("x")
    real_link = os.link

    def cross_device(src, dst):
        if "quality-main" in str(src):
            raise OSError(errno.EXDEV, "Invalid cross-device link", src)
        real_link(src, dst)

    monkeypatch.setattr(quality.os, "link", cross_device)
    work, _ = quality.prepare(runs, "x4-sampled-b", [])
    copy = work / "results" / "prompts" / "train.parquet"
    assert copy.read_bytes() == b"rows" and copy.stat().st_mtime == 1_000_000
    assert copy.stat().st_ino != (prompts / "train.parquet").stat().st_ino
    assert sorted(p.name for p in (work / "results").iterdir()) == ["prompts"]

    def denied(src, dst):
        raise OSError(errno.EACCES, "denied", src)

    monkeypatch.setattr(quality.os, "link", denied)
    (work / "results" / "prompts").rename(work / "results" / "gone")
    with pytest.raises(OSError, match="denied"):  # other errors are not swallowed
        quality.prepare(runs, "x4-sampled-b", [])
    assert not (work / "results" / "prompts").exists()  # and leave no whole-looking folder
