"""One module per kind of run, from a composed config to ``summary.json``: graph federations
(``task=fl``, ``cil``, ``cir``: :mod:`.graph`), FedTIP's task protocol (``task=temporal``:
:mod:`.temporal`), the bank's pre-training (``task=bank``: :mod:`.bank`) and the protocol
manifest (:mod:`.manifest`). Each goes through the run wrapper, :mod:`fedlightning.runs`."""
