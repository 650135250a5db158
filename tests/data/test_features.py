"""`fedlightning data features`: real encoders on real texts and photos, into a dataset."""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

try:  # the `features` extra, which tools/setup.sh installs
    import sentence_transformers  # noqa: F401
except ImportError:
    if os.environ.get("CI"):
        raise
    pytest.skip("pip install -e '.[features]' to run these", allow_module_level=True)

from fedlightning.data.features import ImageEncoder, extract  # noqa: E402
from fedlightning.data.graphs import load_folder  # noqa: E402
from fedlightning.data.graphs.citeseer_mm import read_tape_records  # noqa: E402
from fedlightning.errors import DataError  # noqa: E402

FL = str(Path(sys.executable).parent / "fedlightning")
N = 48  # papers of the raw folder: enough for two clients and two stages
NO_TEXT = (3, 17, 40)  # nodes whose text cell is empty
IMAGED = range(0, 24, 2)  # nodes with a photo
CORRUPT = 30  # a node whose image file is not an image


def cosine_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise cosine similarity of two matrices of the same shape."""
    num = (a * b).sum(1)
    den = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    return num / np.maximum(den, math.ulp(1.0))


def tape(shared_data: Path):
    root = shared_data / "citeseer_tape"
    records = read_tape_records(root / "citeseer_texts.txt")
    ids = json.loads((root / "citeseer_minilm_ids.json").read_text())
    return records, ids, np.load(root / "citeseer_minilm.npy")


def photos() -> list[np.ndarray]:
    from sklearn.datasets import load_sample_images

    return list(load_sample_images().images)  # china.jpg, flower.jpg


def raw_graph(root: Path, shared_data: Path) -> tuple[Path, list[str]]:
    """The first N CiteSeer papers (real abstracts and classes) on a ring, some with photos."""
    from PIL import Image

    records, ids, _ = tape(shared_data)
    ids = ids[:N]
    raw = root / "raw"
    (raw / "images").mkdir(parents=True)
    with (raw / "nodes.csv").open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["id", "text", "label"])
        for i, pid in enumerate(ids):
            text, label = records[pid]
            w.writerow([pid, "" if i in NO_TEXT else text, label])
    with (raw / "edges.csv").open("w", encoding="utf-8") as f:
        f.write("src,dst\n" + "".join(f"{ids[i]},{ids[(i + 1) % N]}\n" for i in range(N)))
    imgs = photos()
    for k, i in enumerate(IMAGED):
        crop = imgs[k % 2][k * 10 : k * 10 + 300, k * 12 : k * 12 + 400]
        suffix = ".jpg" if k % 3 else ".png"
        Image.fromarray(crop).save(raw / "images" / f"{ids[i]}{suffix}")
    (raw / "images" / f"{ids[CORRUPT]}.jpg").write_bytes(b"\xff\xd8 not really a jpeg")
    return raw, ids


def test_photos_get_sensible_imagenet_classes(tmp_path):
    """EfficientNet-Lite0 on scikit-learn's two photos: the Summer Palace and a daisy."""
    import torch
    from PIL import Image

    enc = ImageEncoder()
    for name, img in zip(("china.jpg", "flower.jpg"), photos(), strict=True):
        Image.fromarray(img).save(tmp_path / name)
    x = torch.stack([enc.load(tmp_path / n) for n in ("china.jpg", "flower.jpg")])
    with torch.no_grad():
        top5 = enc.module(x).topk(5, dim=1).indices.tolist()
        pooled = enc.features(x)
    assert 698 in top5[0]  # ImageNet class 698: palace
    assert top5[1][0] == 985  # ImageNet class 985: daisy
    assert pooled.shape == (2, 1280)
    assert enc.load(tmp_path / "missing.jpg") is None


def test_raw_folder_to_dataset_with_masks_and_training(tmp_path, shared_data):
    raw, ids = raw_graph(tmp_path, shared_data)
    env = {**os.environ, "FEDLIGHTNING_CACHE": str(tmp_path / "cache")}
    r = subprocess.run(
        [FL, "data", "features", str(raw), "--out", str(tmp_path / "ds"), "--no-progress"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    bad = f"{ids[CORRUPT]}.jpg"
    assert bad in r.stderr  # the unreadable image is named, and the run went on
    g = load_folder(tmp_path / "ds")
    assert sorted(g.modalities) == ["image", "text"] and g.num_nodes == N
    t, v = g.modalities.index("text"), g.modalities.index("image")
    assert g.features["text"].shape == (N, 384) and g.features["image"].shape == (N, 1280)
    has_text = g.mask[:, t].numpy()
    has_image = g.mask[:, v].numpy()
    assert sorted(np.flatnonzero(~has_text)) == list(NO_TEXT)
    assert sorted(np.flatnonzero(has_image)) == list(IMAGED)  # the corrupt file is masked
    assert not g.features["text"][~g.mask[:, t]].any()  # missing rows are zeros
    assert g.node_ids == ids
    records, all_ids, ref = tape(shared_data)
    rows = [all_ids.index(pid) for pid in ids]
    cos = cosine_rows(g.features["text"].numpy()[has_text], ref[rows][has_text])
    assert cos.min() >= 0.999  # the shipped MiniLM features, rebuilt
    assert g.class_names == sorted({records[pid][1] for pid in ids})
    rec = json.loads((tmp_path / "ds" / "encoders.json").read_text())
    assert rec["modalities"]["image"]["unreadable"] == [str(raw / "images" / bad)]
    assert rec["modalities"]["text"]["missing"] == len(NO_TEXT)
    # the new dataset trains as it is
    train = [
        FL,
        "train",
        "dataset=folder",
        f"dataset.path={tmp_path / 'ds'}",
        "protocol=cil",
        "algorithm=cil_fedavg",
        "task=cil",
        "protocol.stream.stages=[2,2]",
        "federation.clients=2",
        "federation.rounds=1",
        "logger=none",
    ]
    r = subprocess.run(train, cwd=tmp_path, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "am " in r.stdout and "fpr95" in r.stdout


def test_bad_raw_folders_fail_before_encoding(tmp_path, shared_data):
    raw, ids = raw_graph(tmp_path, shared_data)
    with (raw / "edges.csv").open("a") as f:
        f.write(f"{ids[0]},nobody\n")
    with pytest.raises(DataError, match=rf"edges\.csv.*line {N + 2}.*nobody"):
        extract(raw, tmp_path / "out")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    with pytest.raises(DataError, match="refusing to overwrite"):
        extract(raw, tmp_path / "full")
    (raw / "nodes.csv").write_text("id,text\n1,a\n")
    with pytest.raises(DataError, match=r"nodes\.csv.*field `label`"):
        extract(raw, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_citeseer_texts_rebuild_the_shipped_minilm_features(tmp_path, shared_data):
    """A seeded sample of 120 of the 3,186 CiteSeer abstracts through the pipeline: cosine
    >= 0.999 with the shipped features on every row (all of them take many minutes on two
    cores). The sample spans every class and holds abstracts longer than MiniLM's 256-token
    window, which the encoder truncates."""
    records, all_ids, all_ref = tape(shared_data)
    rows = np.sort(np.random.default_rng(0).choice(len(all_ids), size=120, replace=False))
    ids, ref = [all_ids[i] for i in rows], all_ref[rows]
    assert {records[pid][1] for pid in ids} == {label for _, label in records.values()}
    assert any(len(records[pid][0].split()) > 256 for pid in ids)  # > 256 words: truncated
    raw = tmp_path / "citeseer"
    raw.mkdir()
    with (raw / "nodes.jsonl").open("w", encoding="utf-8") as f:
        for pid in ids:
            f.write(
                json.dumps({"id": pid, "text": records[pid][0], "label": records[pid][1]}) + "\n"
            )
    (raw / "edges.csv").write_text("src,dst\n")
    t0 = time.perf_counter()
    rec = extract(raw, tmp_path / "ds", cache_dir=tmp_path / "cache", progress=False)
    seconds = time.perf_counter() - t0
    x = np.load(tmp_path / "ds" / "features" / "text.npy")
    cos = cosine_rows(x, ref)
    print(f"\n{len(ids)} CiteSeer abstracts encoded in {seconds:.1f} s; min cosine {cos.min():.6f}")
    assert x.shape == ref.shape and cos.min() >= 0.999
    assert rec["modalities"]["text"]["dim"] == 384 and rec["modalities"]["text"]["missing"] == 0
