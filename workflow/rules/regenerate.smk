# Stage 2: the target answers the train prompts, one job per shard on devices.extract.
# GPU exclusivity comes from a lease the job process holds (src/dflashpipe/leases.py).


rule regenerate_shard:
    input:
        prompts=f"{RESULTS}/prompts/train.parquet",
        target=target_files,
    output:
        f"{RESULTS}/sequences/shard-{{shard}}.parquet",
    log:
        f"{LOGS}/regenerate/shard-{{shard}}.log",
    benchmark:
        f"{BENCH}/regenerate/shard-{{shard}}.tsv"
    wildcard_constraints:
        shard=r"\d{5}",
    conda:
        "../envs/dflashpipe.yaml"
    threads: 2
    params:
        cli=DFLASHPIPE,
        config=planned_config,
        digest=stage_digest("regenerate"),
        shard=lambda wc: int(wc.shard),
    shell:
        "{params.cli} regenerate --config {params.config} --prompts {input.prompts}"
        " --shard {params.shard} --out {output} > {log} 2>&1"


# Targets list every output up to their stage (upstream_outputs, common.smk).
rule regenerate:
    input:
        upstream_outputs("prompts"),
        sequence_shards(),
