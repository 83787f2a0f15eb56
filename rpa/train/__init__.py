"""GRPO through TRL: run config, tasks, warm start, the TRL adapter, run directories, the collapse rule."""
