"""What the Snakefile and operators call: grid expansion, GPU assignment, the GPU check, the doctor."""
