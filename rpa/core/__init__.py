"""Numerics and kernels, the numerics config, files and errors: what every layer above uses."""
