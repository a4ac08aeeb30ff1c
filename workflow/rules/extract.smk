# Stage 3: target hidden states into compressed Arrow shards, one job per sequences shard, on
# devices.extract (the same GPU leases as regenerate); then one manifest over all shards.


rule extract_shard:
    input:
        sequences=f"{RESULTS}/sequences/shard-{{shard}}.parquet",
        target=target_files,
    output:
        shard=f"{RESULTS}/features/shard-{{shard}}.arrow",
        stats=f"{RESULTS}/features/shard-{{shard}}.stats.json",
    log:
        f"{LOGS}/extract/shard-{{shard}}.log",
    benchmark:
        f"{BENCH}/extract/shard-{{shard}}.tsv"
    wildcard_constraints:
        shard=r"\d{5}",
    conda:
        "../envs/dflashpipe.yaml"
    threads: 4
    params:
        cli=DFLASHPIPE,
        config=planned_config,
        digest=stage_digest("extract"),
        shard=lambda wc: int(wc.shard),
    shell:
        "{params.cli} extract --config {params.config} --sequences {input.sequences}"
        " --shard {params.shard} --out {output.shard} > {log} 2>&1"


rule extract_manifest:
    input:
        shards=feature_shards(),
    output:
        f"{RESULTS}/features/manifest.json",
    log:
        f"{LOGS}/extract/manifest.log",
    conda:
        "../envs/dflashpipe.yaml"
    threads: 1
    params:
        cli=DFLASHPIPE,
        config=planned_config,
    shell:
        "{params.cli} manifest --config {params.config} --shards {input.shards}"
        " --out {output} > {log} 2>&1"


# Targets list every output up to their stage (upstream_outputs, common.smk).
rule extract:
    input:
        upstream_outputs("regenerate"),
        feature_shards(),
        rules.extract_manifest.output,
