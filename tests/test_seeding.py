import subprocess
import sys

from fedlightning.utils.seeding import derive_seed


def test_derive_seed_is_stable_across_processes():
    here = derive_seed(0, "fit", 3, 2)
    code = "from fedlightning.utils.seeding import derive_seed; print(derive_seed(0, 'fit', 3, 2))"
    there = int(subprocess.check_output([sys.executable, "-c", code], text=True))
    assert here == there
    assert derive_seed(0, "fit", 3, 2) != derive_seed(0, "fit", 2, 3)
    assert 0 <= here < 2**63
