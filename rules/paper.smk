# Stage: the paper (`paper`): LaTeX sources in paper/ whose tables and figures are the generated
# files; rebuilt from existing results (no training reruns) with latexmk.


def paper_inputs(wildcards=None):
    inputs = study_outputs() + probe_tables() + analysis_figures()
    if CELLS["dose"]:
        inputs += [f"{R}/tables/dose.md", f"{R}/tables/dose.csv", f"{R}/figures/dose_response.{FIGURES['format']}"]
    if config["search_results"]:
        inputs += [f"{config['search_results']}/tables/search_pilot.json"]
    if config["real_search_results"]:
        inputs += [f"{config['real_search_results']}/tables/search_pilot.json"]
    if config["precision_results"]:
        inputs += [f"{config['precision_results']}/tables/search_grid.json"]
    if config["dose_results"]:
        inputs += [f"{config['dose_results']}/tables/dose_runs.csv", f"{config['dose_results']}/figures/dose_response.png"]
    inputs += [f"{probe}/tables/probe.csv" for probe in config["probe_results"]]
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
    params:
        dose=f"--dose-results {config['dose_results']}" if config["dose_results"] else "",
        search=f"--search-results {config['search_results']}" if config["search_results"] else "",
        real_search=f"--real-search-results {config['real_search_results']}" if config["real_search_results"] else "",
        precision=f"--precision-results {config['precision_results']}" if config["precision_results"] else "",
        probes=" ".join(f"--probe-results {probe}" for probe in config["probe_results"]),
    shell:
        "python -m analysis.paper --results {R} --out-dir {R}/paper {params.dose} {params.search} {params.real_search} "
        "{params.precision} {params.probes} "
        "> {log} 2>&1"
