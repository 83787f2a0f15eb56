"""Mismatch between the sides: scoring, metrics, parity, probe, per-layer diagnosis."""
