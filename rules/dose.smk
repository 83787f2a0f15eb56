# Stage: the positive control (`dose_response`): a sampler-only mismatch dose x IS correction x
# old-logprob source x seeds, plus the x-axis anchors, on one shared warm-started model.


rule dose_response:
    input:
        f"{R}/tables/dose.csv",
        f"{R}/tables/dose.md",
        f"{R}/figures/dose_response.{FIGURES['format']}",


rule dose_aggregate:
    input:
        grid_records("dose"),
    output:
        csv=f"{R}/tables/dose.csv",
        md=f"{R}/tables/dose.md",
        runs=f"{R}/tables/dose_runs.csv",
        sensitivity=f"{R}/tables/dose_sensitivity.csv",
        fig=f"{R}/figures/dose_response.{FIGURES['format']}",
    log:
        f"{R}/logs/dose_aggregate.log",
    conda:
        ENV
    shell:
        "python -m analysis.dose --results {R} --out-dir {R}/tables --figure {output.fig} > {log} 2>&1"
