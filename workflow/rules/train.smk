# Stage 4: drafter training on devices.train, one torchrun process per GPU (gloo on CPU).
# Checkpoints go to results/train/run/, which is not an output: a failed or killed job keeps
# them, and the next attempt resumes from the newest one.


rule train:
    input:
        manifest=f"{RESULTS}/features/manifest.json",
        shards=feature_shards(),
        target=target_files,
        extra=CFG.train.extra_features,
    output:
        config=f"{RESULTS}/drafter/config.json",
        weights=f"{RESULTS}/drafter/model.safetensors",
        metrics=f"{RESULTS}/train/metrics.jsonl",
    log:
        f"{LOGS}/train.log",
    benchmark:
        f"{BENCH}/train.tsv"
    conda:
        "../envs/dflashpipe.yaml"
    threads: 2
    params:
        cli=DFLASHPIPE,
        config=planned_config,
        digest=stage_digest("train"),
        run_dir=f"{RESULTS}/train/run",
        drafter=lambda wildcards, output: Path(output.config).parent,
    shell:
        "{params.cli} train --config {params.config} --manifest {input.manifest}"
        " --run-dir {params.run_dir} --drafter {params.drafter} --metrics {output.metrics}"
        " > {log} 2>&1"
