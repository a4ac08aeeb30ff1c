# dflashpipe: offline DFlash drafter training as staged jobs joined only by files on disk.
#   prompts -> regenerate -> extract -> train -> export -> evaluate -> report
# Each stage lives in workflow/rules/<stage>.smk; helpers and paths in common.smk.
from snakemake.utils import min_version

min_version("9.0")


# The embedded default, unless the user names config files (--configfile): then those alone
# count, so keys of the default (e.g. its GGUF file name) never leak into another recipe.
if not workflow.overwrite_configfiles:

    configfile: "config.yaml"


include: "workflow/rules/common.smk"
include: "workflow/rules/retrieve.smk"
include: "workflow/rules/prompts.smk"
include: "workflow/rules/regenerate.smk"
include: "workflow/rules/extract.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/evaluate.smk"
include: "workflow/rules/report.smk"


# Every stage's outputs, not only the report's: Snakemake reruns a job whose outputs are gone
# only where a target or a job that must run asks for them, so a run killed after Snakemake
# removed a forced stage's outputs would otherwise resume as "Nothing to be done".
rule all:
    default_target: True
    input:
        upstream_outputs("report"),
