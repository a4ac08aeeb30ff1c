# Stage 6: greedy speculative decoding with the exported drafter on the held-out prompts (tau,
# float32 lossless check, speedup vs target-only, prompt-lookup baseline), on one leased GPU.


rule evaluate:
    input:
        drafter_config=rules.train.output.config,
        drafter_weights=rules.train.output.weights,
        prompts=f"{RESULTS}/prompts/eval.parquet",
        target=target_files,
    output:
        metrics=f"{RESULTS}/eval/metrics.json",
    log:
        f"{LOGS}/evaluate.log",
    benchmark:
        f"{BENCH}/evaluate.tsv"
    conda:
        "../envs/dflashpipe.yaml"
    threads: 2
    params:
        cli=DFLASHPIPE,
        config=planned_config,
        digest=stage_digest("evaluate"),
        drafter=lambda wildcards, input: Path(input.drafter_config).parent,
    shell:
        "{params.cli} evaluate --config {params.config} --drafter {params.drafter}"
        " --prompts {input.prompts} --out {output.metrics} > {log} 2>&1"
