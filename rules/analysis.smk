# Stage: tables and figures of the probe grid and the diagnosis.


rule aggregate:
    input:
        probe=probe_summaries(),
        diagnose=diagnose_tables(),
        parity=expand(f"{R}/parity/{{model}}.json", model=MODELS),
    output:
        csv=report(f"{R}/tables/probe.csv", caption="report/probe.rst", category="Probe"),
        md=f"{R}/tables/probe.md",
        diagnose=report(f"{R}/tables/diagnose.csv", caption="report/diagnose.rst", category="Diagnosis"),
    params:
        configs=" ".join(CONFIGS),
    log:
        f"{R}/logs/aggregate.log",
    conda:
        ENV
    shell:
        "python -m analysis.aggregate --results {R} --out-dir {R}/tables --configs {params.configs} > {log} 2>&1"


rule aggregate_sampling:
    input:
        sampling_summaries(),
    output:
        csv=report(f"{R}/tables/probe_sampling.csv", caption="report/probe_sampling.rst", category="Probe"),
        md=f"{R}/tables/probe_sampling.md",
    log:
        f"{R}/logs/aggregate_sampling.log",
    conda:
        ENV
    shell:
        "python -m analysis.probe_sampling --results {R} --out-dir {R}/tables > {log} 2>&1"


rule figures:
    input:
        probe=f"{R}/tables/probe.csv",
        diagnose=f"{R}/tables/diagnose.csv",
        tokens=figure_tokens(),
    output:
        [report(f, caption="report/figures.rst", category="Figures") for f in analysis_figures()],
    params:
        configs=" ".join(FIGURES["dlogp_vs_prob_configs"]) or "none",
    log:
        f"{R}/logs/figures.log",
    conda:
        ENV
    shell:
        "python -m analysis.figures --results {R} --out-dir {R}/figures --format {FIGURES[format]} "
        "--dlogp-configs {params.configs} > {log} 2>&1"
