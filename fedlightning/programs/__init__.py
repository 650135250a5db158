"""One program per kind of run, from a composed config to ``summary.json``: graph federations
(``task=fl``, ``cil``, ``cir``: :mod:`.graph_program`), FedTIP's task protocol (``task=temporal``:
:mod:`.temporal_program`), the bank's pre-training (``task=bank``: :mod:`.bank_program`) and the
protocol manifest (:mod:`.manifest_program`). Each goes through the run wrapper,
:mod:`fedlightning.runs`."""
