# Stage: the paper (`paper`): LaTeX sources in paper/ whose tables and figures are the generated
# files; rebuilt from existing results (no training reruns) with latexmk.


def paper_inputs(wildcards=None):
    inputs = study_outputs() + probe_tables() + analysis_figures()
    if DOSE:
        inputs += [f"{R}/tables/dose.md", f"{R}/tables/dose.csv", f"{R}/figures/dose_response.{FIGURES['format']}"]
    return inputs


rule paper:
    input:
        paper_inputs(),
        sources=["paper/main.tex"],
    output:
        pdf=f"{R}/paper/main.pdf",
        claims=f"{R}/paper/claims.tex",
    log:
        f"{R}/logs/paper.log",
    conda:
        ENV
    shell:
        "python -m analysis.paper --results {R} --out-dir {R}/paper > {log} 2>&1"
