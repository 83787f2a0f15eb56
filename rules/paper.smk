# Stage: the paper (`paper`): LaTeX sources in paper/ whose tables and figures are the generated
# files; rebuilt from existing results (no training reruns) with latexmk. Its further parts are the config's
# paper.sections, each a kind of result (rpa.workflow.paper.SECTION_KINDS) and its results directory.


def paper_inputs(wildcards=None):
    inputs = study_outputs() + probe_tables() + analysis_figures()
    if CELLS["dose"]:
        inputs += [f"{R}/tables/dose.md", f"{R}/tables/dose.csv", f"{R}/figures/dose_response.{FIGURES['format']}"]
    return inputs + section_inputs(PAPER_SECTIONS)


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
    params:
        sections=" ".join(f"--section {kind}={folder}" for kind, folder in PAPER_SECTIONS),
    shell:
        "python -m analysis.paper --results {R} --out-dir {R}/paper {params.sections} > {log} 2>&1"
