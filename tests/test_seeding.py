import subprocess
import sys

import torch

from fedlightning.utils.seeding import derive_seed, manual_seed


def test_derive_seed_is_stable_across_processes():
    here = derive_seed(0, "fit", 3, 2)
    code = "from fedlightning.utils.seeding import derive_seed; print(derive_seed(0, 'fit', 3, 2))"
    there = int(subprocess.check_output([sys.executable, "-c", code], text=True))
    assert here == there
    assert derive_seed(0, "fit", 3, 2) != derive_seed(0, "fit", 2, 3)
    assert 0 <= here < 2**63


def test_manual_seed_leaves_the_cpu_generator_as_torch_manual_seed_does():
    torch.manual_seed(123)
    expected = torch.get_rng_state()
    torch.rand(7)  # move it on
    manual_seed(123)
    assert torch.equal(torch.get_rng_state(), expected)
    assert torch.equal(torch.rand(4), torch.rand(4, generator=torch.Generator().manual_seed(123)))
