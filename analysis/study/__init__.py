"""The study, one kind's package: its runs' table and statistics (:mod:`.stats`: the collapse, mismatch and
sensitivity tables), its figures (:mod:`.figures`) and the command that writes the tables as the paper prints them
(:mod:`.command`; ``python -m analysis.study``). Import from the modules; this package re-exports nothing.
"""
