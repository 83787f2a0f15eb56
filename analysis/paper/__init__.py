"""The paper, one kind's package: its front (:mod:`.front`: the abstract and the claims table), the study's
generated parts (:mod:`.claims`), the further sections by kind (:mod:`.probe`, :mod:`.search`), the rules and
commits the results came from (:mod:`.provenance`) and the command that writes them and builds the PDF
(:mod:`.build`; ``python -m analysis.paper``). Import from the modules; this package re-exports nothing.
"""
