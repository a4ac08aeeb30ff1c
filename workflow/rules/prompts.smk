# Stage 1: collect, normalize, expand, dedupe, filter and split prompts (CPU).


rule prompts:
    input:
        unpack(prompt_source_files),
    output:
        train=f"{RESULTS}/prompts/train.parquet",
        eval=f"{RESULTS}/prompts/eval.parquet",
        stats=f"{RESULTS}/prompts/stats.json",
    log:
        f"{LOGS}/prompts.log",
    benchmark:
        f"{BENCH}/prompts.tsv"
    conda:
        "../envs/dflashpipe.yaml"
    threads: 1
    params:
        cli=DFLASHPIPE,
        config=planned_config,
        digest=stage_digest("prompts"),
    shell:
        "{params.cli} prompts --config {params.config}"
        " --train {output.train} --eval {output.eval} --stats {output.stats} > {log} 2>&1"
