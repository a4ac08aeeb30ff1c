"""torch.compile's work carried between machines (compile_cache.py): a process that compiled
saves a bundle into DFLASHPIPE_COMPILE_CACHE; a later process with an empty Inductor cache (a
fresh machine) loads it and hits the cache instead of compiling, skips a bundle it cannot read,
and adds no bundle of its own when it compiled nothing new. Each process is its own Python, as each stage's is."""

import json
import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import json, logging, torch
    from torch._dynamo.utils import counters
    from dflashpipe.compile_cache import carried

    logging.basicConfig(level=logging.INFO)
    with carried("probe"):
        f = torch.compile(lambda x: (x.sin() + 1).cos() * 2, dynamic=False)
        f(torch.randn(8))
    print(json.dumps(dict(counters["inductor"])))
    """
)


def run(tmp_path, inductor: str, cache) -> tuple[dict, str]:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / inductor),
           "TORCHINDUCTOR_COMPILE_THREADS": "1", "DFLASHPIPE_COMPILE_CACHE": str(cache)}  # fmt: skip
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def test_a_fresh_machine_loads_the_bundle_instead_of_compiling(tmp_path):
    cache = tmp_path / "carried"
    first, log = run(tmp_path, "machine-a", cache)
    assert first.get("fxgraph_cache_miss", 0) >= 1 and not first.get("fxgraph_cache_hit")
    bundles = sorted(cache.glob("probe-*.torchcompile"))
    assert len(bundles) == 1 and bundles[0].stat().st_size > 1000
    assert "compile cache: saved" in log and "inductor 1" in log
    (cache / "truncated.torchcompile").write_bytes(bundles[0].read_bytes()[:100])
    second, log = run(tmp_path, "machine-b", cache)  # an empty Inductor cache: a fresh machine
    assert second.get("fxgraph_cache_hit", 0) >= 1 and not second.get("fxgraph_cache_miss")
    assert f"compile cache: loaded {bundles[0].name}" in log
    assert "compile cache: skipped" in log and "truncated.torchcompile" in log
    assert sorted(cache.glob("probe-*")) == bundles  # nothing new compiled: no second bundle
