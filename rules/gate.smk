# Stage: the parity gate. A model whose parity check fails gets no probe.


rule parity:
    input:
        start_input,
    output:
        f"{R}/parity/{{model}}.json",
    params:
        model=start_path,
        regions=config["parity"]["regions"],
        compiled="--compiled" if config["parity"]["compiled"] else "",
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
        "{params.launch}rpa parity --model {params.model} --regions {params.regions} {params.compiled} "
        "--device {DEVICE} --out {output} > {log} 2>&1"
