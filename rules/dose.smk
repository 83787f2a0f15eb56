# Stage: the positive control (`dose_response`): a sampler-only mismatch dose x IS correction x
# old-logprob source x seeds, plus the x-axis anchors, on one shared warm-started model.


rule dose_response:
    input:
        f"{R}/tables/dose.csv",
        f"{R}/tables/dose.md",
        f"{R}/figures/dose_response.{FIGURES['format']}",


localrules:
    dose_manifest,


rule dose_manifest:
    output:
        f"{R}/dose/manifest.json",
    params:
        text=manifest_text("dose", CELLS["dose"], {"doses": {
            dose_label(d): None if d in (None, "none") else int(d) for d in config["dose"]["doses"]}})
        if CELLS["dose"] else "",
    shell:
        WRITE_TEXT


rule dose_aggregate:
    input:
        grid_records("dose"),
        manifest=f"{R}/dose/manifest.json",
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
