"""The positive control and the dose-responses, one kind's package: the runs' table and the statistics
(:mod:`.stats`: the per-run dose table, groups, the half-collapse threshold by a logistic fit with its
profile-likelihood interval, anchors, sensitivity), the statements (:mod:`.text`), the figure (:mod:`.figures`), the
command (:mod:`.command`; ``python -m analysis.dose``) and the registered dose-response at fixed trainer arithmetic
with its pilot's choice of doses (:mod:`.response`; ``python -m analysis.dose.response``). Import from the modules;
this package re-exports nothing.
"""
