# Shared helpers: config validation, the resolved config file the CLI reads, input functions.
import re
import sys
from pathlib import Path

import yaml
from snakemake.utils import validate

# Parse-time helpers come from this checkout's src/, like the jobs' code (see DFLASHPIPE below).
sys.path.insert(0, str(Path(workflow.basedir) / "src"))
try:
    from dflashpipe.config import Config
    from dflashpipe.errors import ConfigError
    from dflashpipe import stages
    from dflashpipe.checkout import put_first_on_pythonpath
    from dflashpipe.preflight import check_against_target
    from dflashpipe.storage import atomic_path
except ImportError as e:
    raise WorkflowError(
        f"the dflashpipe package is not importable ({e}); install its dependencies with `pip install -e .` in {workflow.basedir}"
    )

# Friendly messages first (unknown key, wrong type, device listed twice, a tap on the target's
# last layer where the target is on disk), then the standard Snakemake validation against the
# same schema, which also fills in the defaults.
try:
    CFG = Config.from_dict(config, origin="config")
    check_against_target(CFG)
except ConfigError as e:
    raise WorkflowError(str(e))
validate(config, "../schemas/config.schema.yaml")

RESULTS = "results"
LOGS = f"{RESULTS}/logs"
BENCH = f"{RESULTS}/benchmarks"
RESOLVED_CONFIG = f"{RESULTS}/config.resolved.yaml"
# Jobs run this checkout's code (locally, under --sdm conda, in SLURM jobs) through the
# environment, not the command; src/dflashpipe/checkout.py says why.
put_first_on_pythonpath(str(Path(workflow.basedir) / "src"))
DFLASHPIPE = "python -m dflashpipe"


def write_resolved_config(path=RESOLVED_CONFIG):
    """The CLI reads the merged config (configfile + --config overrides) from this file. It is
    rewritten only when its content changes, so its mtime never triggers reruns by itself.
    """
    text = yaml.safe_dump(CFG.raw, sort_keys=False)
    p = Path(path)
    if p.is_file() and p.read_text(encoding="utf-8") == text:
        return
    with atomic_path(p) as tmp:
        tmp.write_text(text, encoding="utf-8")


write_resolved_config()


def retrieve_dests():
    return [spec.dest for spec in CFG.retrieve.values()]


def stage_digest(stage):
    """Rules carry this as a param: editing a key the stage reads (src/dflashpipe/stages.py)
    reruns that stage, and Snakemake then what lies downstream of it."""
    return stages.digest(CFG, stage)


def retrieve_digest(wildcards):
    """A retrieve job's param: its own entry, so an edit refetches that one file."""
    spec = next(s for s in CFG.retrieve.values() if s.dest == wildcards.dest)
    return stages.hash_values(spec.digest_values())


def prompt_source_files(wildcards):
    """Named inputs of the prompts rule: every file-based source (retrievable or the
    user's; <stdlib> is the interpreter's, no input) and prompts.exclude's files."""
    files = {s.name: s.file for s in CFG.prompts.sources if s.file}
    return files | {f"exclude-{i}": path for i, path in enumerate(CFG.prompts.exclude)}


def target_files(wildcards):
    """Local target files as inputs (so `retrieve` fetches the default); none for a hub id."""
    model = Path(CFG.target.model)
    if CFG.target.gguf_file:
        return [str(model / CFG.target.gguf_file)]
    return [str(model)] if model.exists() else []


def sequence_shards():
    n = CFG.regenerate.shards
    return [f"{RESULTS}/sequences/shard-{i:05d}.parquet" for i in range(n)]


def feature_shards():
    n = CFG.regenerate.shards
    return [f"{RESULTS}/features/shard-{i:05d}.arrow" for i in range(n)]
