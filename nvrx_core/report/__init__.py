"""`nvrx report`: what happened in a run, who caused it, and what fraction of the time trained.

Reads the events every part writes (nvrx_core.events): `events_file` loads them line by line,
`incidents` cuts the run into failed cycles and times each, `attribution` names each
incident's culprit from the evidence the monitors gathered, `goodput` splits the wall time
into productive training and where the rest went, `text` prints it, `plot` draws it
(optional: `pip install nvrx-suite[report]`).
"""
