# Stage: the parity gate. A model whose parity check fails gets no probe. One job file a model.


localrules:
    write_parity_job,


rule write_parity_job:
    output:
        f"{R}/jobs/parity/{{model}}.yaml",
    params:
        text=lambda wc: yaml_text(parity_job(config, start_path(wc), DEVICE)),
    shell:
        WRITE_TEXT


rule parity:
    input:
        start_input,
        job=f"{R}/jobs/parity/{{model}}.yaml",
    output:
        f"{R}/parity/{{model}}.json",
    params:
        launch=gpu_launch(GPU),
    log:
        f"{R}/logs/parity/{{model}}.log",
    conda:
        ENV
    resources:
        mem_mb=config["job_mem_mb"],
        runtime=30,
        gpu=GPU,
    shell:
        "{params.launch}rpa parity --config {input.job} --out {output} > {log} 2>&1"
