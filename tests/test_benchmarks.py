"""Benchmark scripts' smoke runs (CPU, tiny shapes): the GPU runs find them working."""

import importlib.util
import json
import sys

from conftest import REPO


def _script(name: str):
    """benchmarks/{name}.py as a module (a script, not part of the package)."""
    spec = importlib.util.spec_from_file_location(
        f"bench_{name}", REPO / "benchmarks" / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_regenerate_benchmark_smoke(tmp_path):
    """Engine and generate() at both shapes, each against its bound on the card named (the CPU
    has none: an H100 SXM's figures given), in one run."""
    out = tmp_path / "regen.json"
    rows = _script("regenerate").main(["--smoke", "--out", str(out), "--hbm-tbs", "3.35",
                                       "--tflops", "989"])  # fmt: skip
    assert {(r["shape"], r["path"]) for r in rows} == {
        (s, p) for s in ("recipe", "qwen3-8b") for p in ("engine", "generate()")
    }
    for r in rows:
        assert r["tok_s"] > 0 and r["bound_ms"] > 0 and r["step_bound_share"] > 0
        # the run's bound counts the prefill at the peak beside the decode steps' bytes
        decode_only = r["rows"] / (r["bound_ms"] / 1e3)
        assert r["prefill_bound_s"] > 0 and r["bound_tok_s"] < decode_only
    assert json.loads(out.read_text())["hbm_bytes_per_s"] == 3.35e12
    engine = [r for r in rows if r["path"] == "engine"]
    assert all(r["captures_in_run"] == 0 and r["step_alone_ms"] > 0 for r in engine)
    # real stopping at the recipe's shapes: answers shorter than max_new_tokens
    assert rows[0]["tokens_per_answer"] < 16
    assert json.loads(out.read_text())["rows"] == rows


def test_evaluate_benchmark_smoke(tmp_path):
    """Every method's step on the eager loop and the engine at both shapes, each priced in
    target steps, as the GPU run's table reads them."""
    out = tmp_path / "evaluate.json"
    res = _script("evaluate").main(["--smoke", "--budgets", "16", "--out", str(out)])
    assert json.loads(out.read_text())["args"]["smoke"] is True
    for shape in ("smollm2", "qwen3-8b"):
        methods = res[shape]["methods"]
        for name in ("eager target", "eager dflash", "engine (no graphs) target",
                     "engine (no graphs) dflash", "engine (no graphs) ddtree@16"):  # fmt: skip
            assert methods[name]["ms_per_step"] > 0 and methods[name]["steps"] > 0
        assert methods["engine (no graphs) target"]["x_target_step"] == 1.0
        assert methods["engine (no graphs) dflash"]["x_target_step"] > 1.0
