# Stage 7: plots and a Markdown summary; `snakemake --report report.html` gathers them.


rule report:
    input:
        train=rules.train.output.metrics,
        eval=rules.evaluate.output.metrics,
        prompts=rules.prompts.output.stats,
        manifest=rules.extract_manifest.output[0],
        extra=CFG.train.extra_features,
    output:
        loss=report(f"{RESULTS}/report/loss.png", category="Training"),
        acceptance=report(f"{RESULTS}/report/acceptance.png", category="Training"),
        histogram=report(f"{RESULTS}/report/histogram.png", category="Evaluation"),
        summary=report(f"{RESULTS}/report.md", category="Summary"),
    log:
        f"{LOGS}/report.log",
    conda:
        "../envs/dflashpipe.yaml"
    threads: 1
    params:
        cli=DFLASHPIPE,
        config=planned_config,
        plots=lambda wildcards, output: Path(output.loss).parent,
    shell:
        "{params.cli} report --config {params.config} --train-metrics {input.train}"
        " --eval-metrics {input.eval} --prompt-stats {input.prompts} --manifest {input.manifest}"
        " --extra-manifest {input.extra} --plots {params.plots} --out {output.summary} > {log} 2>&1"
