"""The programs' shared parts (:mod:`fedlightning.programs`)."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from fedlightning.errors import ConfigError
from fedlightning.programs import Program, secure_on


def test_secure_sums_are_refused_on_flower_nodes_in_one_line():
    on = OmegaConf.create({"federation": {"secure_sum": True}})
    off = OmegaConf.create({"federation": {"secure_sum": False}})
    assert secure_on(on, flower=False) and not secure_on(off, flower=True)
    with pytest.raises(ConfigError, match="runner=flower does not mask") as e:
        secure_on(on, flower=True)
    assert e.value.key == "federation.secure_sum" and "\n" not in str(e.value)


def test_a_program_must_supply_its_parts():
    job = Program(OmegaConf.create({}))
    job.check()  # nothing to refuse by default
    for part in (job.prepare, job.work, job.fields, job.outputs):
        with pytest.raises(NotImplementedError):
            part()
