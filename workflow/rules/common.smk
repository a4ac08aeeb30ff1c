# Shared helpers: config checks, the config file each job reads, input functions.
import hashlib
import re
import sys
from pathlib import Path

import yaml
from snakemake.utils import validate

# Parse-time helpers come from this checkout's src/, like the jobs' code (see DFLASHPIPE below).
sys.path.insert(0, str(Path(workflow.basedir) / "src"))
try:
    from dflashpipe.errors import ConfigError
    from dflashpipe import stages
    from dflashpipe.checkout import put_first_on_pythonpath
    from dflashpipe.preflight import check_workflow_config
    from dflashpipe.storage import atomic_path
except ImportError as e:
    raise WorkflowError(
        f"the dflashpipe package is not importable ({e}); install its dependencies with `pip install -e .` in {workflow.basedir}"
    )

# Friendly messages first (unknown key, wrong type, device listed twice, a file the config names
# that is not there, a tap on the target's last layer where the target is on disk), each naming
# the config file(s); then the standard Snakemake validation against the same schema, which also
# fills in the defaults. A message and exit status 1, not an exception: Snakemake would print
# this file's line and a traceback before the message.
CONFIG_ORIGIN = ", ".join(map(str, workflow.configfiles)) or "config"
if workflow.config_settings.config:
    CONFIG_ORIGIN += " with --config overrides"
try:
    CFG = check_workflow_config(config, CONFIG_ORIGIN)
except ConfigError as e:
    print(f"dflashpipe: {e}", file=sys.stderr)
    sys.exit(1)
validate(config, "../schemas/config.schema.yaml")

RESULTS = "results"
LOGS = f"{RESULTS}/logs"
BENCH = f"{RESULTS}/benchmarks"
# Jobs read the config they were planned with: the merged config (configfiles + --config) under
# its own digest, written when a run starts (onstart: never by a dry run or another planning
# pass), so a later `snakemake` call with another config never changes what a running job
# reads. RESOLVED_RECORD is the same text for people and tools, the last run's.
CONFIG_TEXT = yaml.safe_dump(CFG.raw, sort_keys=False)
PLANNED_CONFIG = (
    f"{RESULTS}/configs/{hashlib.sha256(CONFIG_TEXT.encode()).hexdigest()[:16]}.yaml"
)
RESOLVED_RECORD = f"{RESULTS}/config.resolved.yaml"
# Jobs run this checkout's code (locally, under --sdm conda, in SLURM jobs) through the
# environment, not the command; src/dflashpipe/checkout.py says why.
put_first_on_pythonpath(str(Path(workflow.basedir) / "src"))
DFLASHPIPE = "python -m dflashpipe"


def write_config(path):
    """Write CONFIG_TEXT to `path` unless it holds it already (its mtime never changes alone)."""
    p = Path(path)
    if p.is_file() and p.read_text(encoding="utf-8") == CONFIG_TEXT:
        return
    with atomic_path(p) as tmp:
        tmp.write_text(CONFIG_TEXT, encoding="utf-8")


onstart:
    write_config(PLANNED_CONFIG)
    write_config(RESOLVED_RECORD)


def planned_config(wildcards, output):
    """A job's --config: PLANNED_CONFIG. A function of the output, so Snakemake counts it as
    derived and leaves it out of the params it compares for reruns: the stage digests decide
    those, and a path that moves with every edit would rerun every stage."""
    return PLANNED_CONFIG


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


def upstream_outputs(stage):
    """Every output of the stages up to `stage`, in the workflow's order (retrieve's are inputs).
    Aggregate targets list them all because Snakemake reruns a job whose outputs are missing
    only where a target or a job that must run asks for them: a run killed after Snakemake
    removed a forced stage's outputs (`--forcerun train`) must resume that stage and what
    follows it on `--rerun-incomplete`, not report "Nothing to be done"."""
    made = {
        "prompts": lambda: list(rules.prompts.output),
        "regenerate": sequence_shards,
        "extract": lambda: [*feature_shards(), *rules.extract_manifest.output],
        "train": lambda: list(rules.train.output),
        "evaluate": lambda: list(rules.evaluate.output),
        "report": lambda: list(rules.report.output),
    }
    order = list(made)
    return [f for name in order[: order.index(stage) + 1] for f in made[name]()]
