"""MAGB / OpenMAG-style folders: a fixture written in that layout, loaded and trained on."""

from __future__ import annotations

import csv

import numpy as np
import pytest
import torch

from fedlightning.data.graphs import load_magb
from fedlightning.errors import DataError
from fedlightning.train import train

N, C = 60, 4


def write_magb(root, name="Toys", neighbors=True, text_files=("Toys_minilm_256_mean.npy",)):
    """A 60-node folder as MAGB publishes one: node CSV, TextFeature/, ImageFeature/."""
    folder = root / name
    (folder / "TextFeature").mkdir(parents=True)
    (folder / "ImageFeature").mkdir()
    rng = np.random.default_rng(0)
    y = np.arange(N) % C
    with (folder / f"{name}.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["id", "asin", "text", "label", *(["neighbors"] if neighbors else [])])
        for i in range(N):
            nbrs = f"[{(i + 1) % N}, {(i + 3) % N}]"  # ring and chords, "[a, b]" strings
            w.writerow(
                [i, f"B{i:05d}", f"item {i}, with a comma", y[i], *([nbrs] if neighbors else [])]
            )
    for fname in text_files:
        np.save(
            folder / "TextFeature" / fname,
            (y[:, None] + rng.normal(size=(N, 8))).astype(np.float32),
        )
    img = (y[:, None] + rng.normal(size=(N, 5))).astype(np.float32)
    img[[4, 9]] = 0.0  # two products without a picture
    img[11, 0] = np.nan
    np.save(folder / "ImageFeature" / f"{name}_clip.npy", img)
    return folder, y


def test_loads_labels_edges_features_and_masks(tmp_path):
    folder, y = write_magb(tmp_path)
    g = load_magb(folder)
    assert g.name == "Toys" and g.modalities == ["text", "image"]
    assert torch.equal(g.y, torch.from_numpy(y))
    assert g.features["text"].shape == (N, 8) and g.features["image"].shape == (N, 5)
    # the neighbor lists give i-(i+1) and i-(i+3), made undirected: 4 neighbours each
    assert g.edge_index.shape[1] == 4 * N
    assert set(g.edge_index[1, g.edge_index[0] == 0].tolist()) == {1, 3, N - 1, N - 3}
    missing = (~g.mask[:, 1]).nonzero().squeeze(1).tolist()
    assert missing == [4, 9, 11] and bool(g.mask[:, 0].all())
    assert not g.features["image"][11].isnan().any()  # the NaN row is zeroed, not passed on


def test_feature_choice_and_missing_graph_are_named(tmp_path):
    folder, _ = write_magb(tmp_path, text_files=("Toys_a.npy", "Toys_b.npy"))
    with pytest.raises(DataError, match=r"TextFeature.*dataset\.text_feature"):
        load_magb(folder)
    assert load_magb(folder, text_feature="Toys_b.npy").features["text"].shape == (N, 8)
    other, _ = write_magb(tmp_path / "x", neighbors=False)
    with pytest.raises(DataError, match=r"Toys\.csv.*edges\.csv"):
        load_magb(other)


def test_trains_cil_fedavg_from_the_config(tmp_env, compose):
    folder, _ = write_magb(tmp_env)
    cfg = compose(
        [
            "dataset=magb",
            f"dataset.path={folder}",
            "protocol=cil",
            "algorithm=cil_fedavg",
            "task=cil",
            "protocol.stream.stages=[2,1]",
            "federation.clients=2",
            "federation.rounds=1",
            "logger=none",
        ]
    )
    s = train(cfg, tmp_env / "run", verbose=False)
    assert s["tags"]["dataset"] == "Toys" and "am" in s["metrics"]
