"""Hostile values in a folder graph end in one line before any allocation or warning
(docs/datasets.md): a label id of 2**31 names the node and the label instead of trying to
allocate two billion classes; a feature value beyond float32 is told in the one error line,
without numpy's overflow warning as a second line."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse

from fedlightning.data.graphs import load_folder
from fedlightning.errors import DataError

N = 6


def folder(path: Path, labels=None, text=None, sparse=False) -> Path:
    (path / "features").mkdir(parents=True)
    np.save(path / "edge_index.npy", np.array([[0, 1, 2], [1, 2, 3]]))
    np.save(path / "labels.npy", np.array(labels if labels is not None else [0, 1, 0, 1, 0, 1]))
    x = np.ones((N, 2)) if text is None else np.asarray(text)
    if sparse:
        scipy.sparse.save_npz(path / "features" / "text.npz", scipy.sparse.csr_matrix(x))
    else:
        np.save(path / "features" / "text.npy", x)
    return path


@pytest.mark.parametrize("label", [2**31, 2**62, 70_000], ids=["2**31", "2**62", "70000"])
def test_a_huge_label_id_is_named_before_allocation(tmp_path, label):
    labels = [0, 1, 0, label, 0, 1]
    with pytest.raises(DataError, match=rf"node 3 has class id {label}") as e:
        load_folder(folder(tmp_path / "g", labels))
    assert "labels.npy" in str(e.value) and "\n" not in str(e.value)


def test_label_ids_up_to_the_limit_still_load(tmp_path):
    """Unused class ids are allowed (a graph may lack a class), up to 2**16 of them."""
    g = load_folder(folder(tmp_path / "g", [0, 1, 0, 9, 0, 1]))
    assert g.num_classes == 10 and g.y.tolist() == [0, 1, 0, 9, 0, 1]


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_a_feature_beyond_float32_is_one_line_without_a_warning(tmp_path, sparse):
    x = np.ones((N, 2))
    x[4, 1] = 1e39  # finite in float64, inf in float32
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy's RuntimeWarning would raise here
        with pytest.raises(DataError, match=r"beyond float32.*1 row\(s\), first row 4") as e:
            load_folder(folder(tmp_path / "g", text=x, sparse=sparse))
    assert "\n" not in str(e.value) and "modality 'text'" in str(e.value)
