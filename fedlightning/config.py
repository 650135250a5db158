"""The config: composition (:func:`compose`), checks before any data is read
(:func:`validate`), and instantiation that reports errors against the key (:func:`build`)."""

from __future__ import annotations

import difflib
import json
import logging
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from fedlightning.errors import ConfigError, FedLightningError
from fedlightning.resources import conf_dir

if TYPE_CHECKING:
    from fedlightning.data.temporal.events import EventStream

log = logging.getLogger(__name__)

CONF_DIR = str(conf_dir())  # fedlightning/resources.py: the package's or the checkout's conf/
# Keys of a dataset config that are not its loader's arguments: the name the run takes
# (declared by every dataset config) and the graph keys applied after loading.
DISPLAY_NAME_KEY = "display_name"
GRAPH_ONLY_KEYS = ("missing_rate", "sparse_modalities")


def data_name(value: Any, kind: str = "name", override: Any = None) -> str:
    """The resolver ``${fl.data_name:VALUE,KIND,NAME}`` of the dataset configs'
    ``display_name`` (docs/datasets.md): ``override`` when set, else ``value`` read by
    ``kind``: ``file`` (its stem), ``folder`` (its ``meta.json`` name, else the folder's
    name), ``dir`` (the folder's name) or ``name`` (as is); characters other than letters,
    digits, ``.``, ``-``, ``_`` become ``_``. An unreadable ``meta.json`` is left to the loader."""
    if override is not None and str(override) != "":
        raw = str(override)
    elif kind == "file":
        raw = Path(str(value)).stem
    elif kind in ("folder", "dir"):
        folder = Path(str(value)).expanduser().resolve()
        raw = (_meta_name(folder) if kind == "folder" else None) or folder.name
    elif kind == "name":
        raw = str(value)
    else:
        raise ValueError(f"fl.data_name: kind must be file, folder, dir or name, got {kind!r}")
    return re.sub(r"[^\w.-]+", "_", raw).strip("._") or "data"


def _meta_name(folder: Path) -> str | None:
    try:
        name = json.loads((folder / "meta.json").read_text(encoding="utf-8")).get("name")
    except (OSError, ValueError, AttributeError):
        return None
    return str(name) if name else None


def run_label(cfg: Any) -> str:
    """The dataset's ``display_name`` (``data`` for a config without one)."""
    return str(OmegaConf.select(cfg, f"dataset.{DISPLAY_NAME_KEY}", default=None) or "data")


if not OmegaConf.has_resolver("fl.data_name"):
    OmegaConf.register_new_resolver("fl.data_name", data_name)


def compose(overrides: list[str]) -> DictConfig:
    """``conf/train.yaml`` composed with ``overrides``, as ``fedlightning train`` would."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return hydra_compose(config_name="train", overrides=overrides)


def _get(cfg: DictConfig, key: str) -> Any:
    try:
        return OmegaConf.select(cfg, key, throw_on_missing=True)
    except Exception as e:  # a mandatory `???` value, or an interpolation that fails
        raise ConfigError(key, f"has no value ({e.__class__.__name__}: {e})") from None


def _int(cfg: DictConfig, key: str, low: int) -> int:
    v = _get(cfg, key)
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise ConfigError(key, f"must be an integer >= {low}, got {v!r}")
    return v


def _float(cfg: DictConfig, key: str, low: float, high: float, low_open: bool = False) -> float:
    v = _get(cfg, key)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ConfigError(key, f"must be a number, got {v!r}")
    if v > high or v < low or (low_open and v == low):
        bound = "(" if low_open else "["
        raise ConfigError(key, f"must lie in {bound}{low}, {high}], got {v}")
    return float(v)


MINIBATCH_KEY = "federation.minibatch"
MINIBATCH_KEYS = (
    "budget_nodes",
    "batch_size",
    "fanout",
    "inference_batch_size",
    "inference_fanout",
)


def check_minibatch(value: Any) -> dict[str, Any] | None:
    """``federation.minibatch`` (docs/scaling.md, "Mini-batch clients"): ``None`` (off), or
    ``{budget_nodes, batch_size, fanout[, inference_batch_size, inference_fanout]}`` with
    whole numbers >= 1 and fanouts of whole numbers >= 1 or -1 (every neighbour); the
    checked mapping, without torch."""
    if value is None:
        return None
    if isinstance(value, DictConfig):
        value = OmegaConf.to_container(value, resolve=True)
    if not isinstance(value, dict):
        raise ConfigError(MINIBATCH_KEY, f"must be null or a mapping, got {value!r}")
    unknown = sorted(set(value) - set(MINIBATCH_KEYS))
    if unknown:
        raise ConfigError(MINIBATCH_KEY, f"unknown keys {unknown}; known: {list(MINIBATCH_KEYS)}")
    out = {"budget_nodes": 200_000, "batch_size": 1024, "fanout": [10, 10]}
    out |= {"inference_batch_size": 4096, "inference_fanout": None} | value
    for key in ("budget_nodes", "batch_size", "inference_batch_size"):
        v = out[key]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"{MINIBATCH_KEY}.{key}", f"must be an integer >= 1, got {v!r}")
    for key in ("fanout", "inference_fanout"):
        v = out[key]
        if v is None and key == "inference_fanout":
            continue
        if (
            not isinstance(v, (list, tuple))
            or not v
            or any(isinstance(k, bool) or not isinstance(k, int) or k == 0 or k < -1 for k in v)
        ):
            raise ConfigError(
                f"{MINIBATCH_KEY}.{key}",
                f"must be a non-empty list of integers >= 1 or -1 (all neighbours), got {v!r}",
            )
        out[key] = [int(k) for k in v]
    return out


def plots_on(cfg: DictConfig) -> bool:
    """``plots``: whether a run draws its PNG plots (``FEDLIGHTNING_PLOTS``, default true;
    a run saved before the key existed draws them)."""
    return _get(cfg, "plots") if "plots" in cfg else True


def dataset_label(cfg: DictConfig) -> str:
    """How messages name the dataset before it is read: its ``display_name``, else its
    ``name``, quoted."""
    ds = OmegaConf.select(cfg, "dataset", default=None) or {}
    for key in (DISPLAY_NAME_KEY, "name"):
        try:
            value = ds.get(key)
        except Exception:  # an interpolation that fails
            value = None
        if value:
            return repr(str(value))
    return "the dataset"


def validate_protocol(cfg: DictConfig) -> None:
    """The partitioner's parameters and, under ``protocol=cil``, the stage layout (against
    the number of classes where the config fixes it), ``client_fraction`` and a validation
    fraction > 0 (docs/datasets.md); a :class:`ConfigError` naming the key."""
    from fedlightning.data.streams import STAGES_KEY, check_stages, config_num_classes

    stream = OmegaConf.select(cfg, "protocol.stream", default=None)
    if stream is not None:
        check_stages(
            _get(cfg, STAGES_KEY), config_num_classes(_get(cfg, "dataset")), dataset_label(cfg)
        )
        build(stream, "protocol.stream")  # its constructor checks client_fraction
    split = getattr(build(_get(cfg, "partition"), "partition"), "split", None)  # and alpha...
    if stream is not None and split is not None and split[1] <= 0:
        raise ConfigError(
            "partition.split",
            f"the class-incremental protocol calibrates its rejection threshold on validation "
            f"nodes: the validation fraction must be > 0, got {list(split)}",
        )


def check_resolves(cfg: DictConfig) -> None:
    """Every interpolation of ``cfg`` resolves (``${oc.env:VAR}`` of an unset variable,
    a reference to a missing key): else a :class:`ConfigError` naming the key."""
    from omegaconf.errors import InterpolationResolutionError

    try:
        OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
    except InterpolationResolutionError as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(str(e.full_key or "?"), f"does not resolve ({reason})") from None


# Trainer arguments the executor sets for every local fit: not the trainer group's.
EXECUTOR_SET = (
    "max_epochs", "min_epochs", "max_steps", "logger", "callbacks", "enable_checkpointing",
    "enable_progress_bar", "enable_model_summary", "num_sanity_val_steps", "limit_val_batches",
)  # fmt: skip
EXECUTOR_KEYS = ("accelerator", "devices", "precision", "strategy")  # runner.executor's own
TRAINER_GROUP_KEYS = (
    *EXECUTOR_KEYS, "deterministic", "gradient_clip_val", "gradient_clip_algorithm",
)  # fmt: skip
GPU_ACCELERATORS = ("gpu", "cuda")


def trainer_settings(cfg: DictConfig) -> dict[str, Any]:
    """The Trainer arguments of a run's local fits: the ``trainer`` group, with what
    ``runner.executor`` sets itself (``runner.executor.accelerator=gpu``) on top."""
    settings = dict(OmegaConf.to_container(_get(cfg, "trainer"), resolve=True))
    executor = OmegaConf.select(cfg, "runner.executor", default=None) or {}
    settings.update({k: _get(cfg, f"runner.executor.{k}") for k in EXECUTOR_KEYS if k in executor})
    return settings


def lean_refusal(settings: dict[str, Any]) -> tuple[str, str] | None:
    """``(key, why)`` for the first Trainer setting that the lean executor cannot honour
    (it honours cpu, auto or one GPU, 32-bit precision, ``deterministic`` and gradient
    clipping); ``None`` when it honours them all."""
    hint = "; use runner=sequential_trainer, whose lightning.Trainer takes it"
    rules = {
        "accelerator": lambda v: v in ("cpu", "auto", *GPU_ACCELERATORS),
        "devices": lambda v: v in (1, "1", "auto", [0]),
        "precision": lambda v: str(v) in ("32", "32-true"),
        "strategy": lambda v: v in ("auto", "single_device"),
        "deterministic": lambda v: v in (True, False, "warn"),
        "gradient_clip_val": lambda v: v is None or (isinstance(v, (int, float)) and v >= 0),
        "gradient_clip_algorithm": lambda v: v in ("norm", "value"),
    }
    for key, value in settings.items():
        if key not in rules:
            return key, f"is no setting of the lean executor (runner=sequential){hint}"
        if not rules[key](value):
            return key, f"{value!r}: the lean executor (runner=sequential) cannot honour it{hint}"
    return None


def check_trainer(cfg: DictConfig) -> None:
    """The ``trainer`` group against the runner's executor, before any data is read: keys
    the executor sets itself, what the lean executor cannot honour, and an accelerator this
    machine lacks; a :class:`ConfigError` naming the key."""
    if OmegaConf.select(cfg, "trainer", default=None) is None:
        return  # a run saved before the trainer group existed
    settings = trainer_settings(cfg)
    for key in settings:
        if key in EXECUTOR_SET:
            raise ConfigError(
                f"trainer.{key}", "is set by the executor for every local fit "
                "(the epochs: federation.local_epochs); remove it",
            )  # fmt: skip
    target = str(OmegaConf.select(cfg, "runner.executor._target_", default=""))
    if target.endswith(".LeanExecutor") and (refused := lean_refusal(settings)):
        raise ConfigError(f"trainer.{refused[0]}", refused[1])
    if target.endswith(".TrainerExecutor"):
        _check_trainer_arguments(settings)
    accelerator = str(settings.get("accelerator", "cpu"))
    if accelerator in GPU_ACCELERATORS and not _cuda_available():
        raise ConfigError(
            "trainer.accelerator",
            f"{accelerator}: this machine has no CUDA GPU that torch can use "
            "(torch.cuda.is_available() is False); use trainer.accelerator=cpu",
        )


def _check_trainer_arguments(settings: dict[str, Any]) -> None:
    """Every key is an argument of ``lightning.Trainer`` (imported only for a key that is
    not one of the trainer group's own)."""
    unknown = [k for k in settings if k not in TRAINER_GROUP_KEYS]
    if not unknown:
        return
    import inspect

    from lightning.pytorch import Trainer

    known = inspect.signature(Trainer.__init__).parameters
    for key in unknown:
        if key not in known:
            close = difflib.get_close_matches(key, list(known), n=1)
            hint = f"; did you mean trainer.{close[0]}?" if close else ""
            raise ConfigError(f"trainer.{key}", f"is no argument of lightning.Trainer{hint}")


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


# Hand-written rather than structured configs or pydantic: the rules cross groups (stages
# against the graph's classes, clients against nodes) and each error names the key and the
# expectation in one line before torch is imported; the trainer group alone is typed.
def validate(cfg: DictConfig) -> None:
    """Fail with a :class:`ConfigError` naming the key for any invalid value; every rule
    the config alone decides is checked here, before any data is read."""
    check_resolves(cfg)
    missing = sorted(k for k in OmegaConf.missing_keys(cfg) if not k.startswith("hydra"))
    if missing:
        raise ConfigError(
            missing[0],
            f"is required (`???` in the config); set it on the command line, e.g. {missing[0]}=...",
        )
    if not isinstance(plots_on(cfg), bool):
        raise ConfigError("plots", f"must be true or false, got {plots_on(cfg)!r}")
    _int(cfg, "seed", 0)
    _int(cfg, "protocol.seed", 0)
    _int(cfg, "federation.clients", 1)
    _int(cfg, "federation.rounds", 1)
    _int(cfg, "federation.local_epochs", 1)
    _float(cfg, "federation.participation", 0.0, 1.0, low_open=True)
    net = _get(cfg, "model.net")
    if "conv" in net and net.conv not in ("gcn", "sage"):
        raise ConfigError("model.net.conv", f"must be 'gcn' or 'sage', got {net.conv!r}")
    if "hidden" in net:
        _int(cfg, "model.net.hidden", 1)
    if "dropout" in net:
        _float(cfg, "model.net.dropout", 0.0, 0.99)
    if "lr" in _get(cfg, "model.optimizer"):
        _float(cfg, "model.optimizer.lr", 0.0, 10.0, low_open=True)
    validate_protocol(cfg)
    check_minibatch(OmegaConf.select(cfg, MINIBATCH_KEY, default=None))
    if "path" in _get(cfg, "dataset"):
        path = _get(cfg, "dataset.path")
        if not Path(str(path)).is_dir():
            raise ConfigError(
                "dataset.path",
                f"must be a folder in the documented format "
                f"(docs/datasets.md); {path!r} is not a directory",
            )
    if cfg.get("resume") and not (Path(cfg.resume) / "checkpoint.pt").is_file():
        raise ConfigError(
            "resume",
            f"{cfg.resume!r} holds no checkpoint.pt; pass the run directory of an earlier run",
        )


def dataset_node(cfg: DictConfig) -> tuple[DictConfig, dict[str, Any]]:
    """``cfg.dataset`` (resolved) as its loader takes it, and the keys taken out of it
    (``display_name`` and the graph keys applied after loading, ``missing_rate``)."""
    node = OmegaConf.to_container(cfg.dataset, resolve=True)
    taken = {k: node.pop(k) for k in (DISPLAY_NAME_KEY, *GRAPH_ONLY_KEYS) if k in node}
    return OmegaConf.create(node), taken


def build_stream(cfg: DictConfig) -> EventStream:
    """The temporal event stream of ``cfg.dataset`` (graph keys such as ``missing_rate``
    ignored); a :class:`ConfigError` naming ``dataset`` when it is not a stream."""
    from fedlightning.data.temporal.events import EventStream

    node, taken = dataset_node(cfg)
    ignored = {k: v for k, v in taken.items() if k in GRAPH_ONLY_KEYS and v}
    if ignored:
        log.info("an interaction stream has no modalities; ignoring dataset keys %s", ignored)
    stream = build(node, "dataset")
    if not isinstance(stream, EventStream):
        raise ConfigError(
            "dataset",
            f"{type(stream).__name__} is not a temporal event stream; choose a stream "
            "(dataset=interactions, jodie, wikipedia, bitcoin_alpha, synthetic_stream)",
        )
    return stream


# A key of every algorithm config that is not its class's argument: the name the recipes
# give its runs (``cil_${algorithm.method}_<data>``; docs/experiments.md).
METHOD_KEY = "method"


def build(node: Any, key: str, **kwargs: Any) -> Any:
    """``hydra.utils.instantiate``: our own errors come through unwrapped, anything else
    becomes a :class:`ConfigError` naming ``key``. An algorithm's :data:`METHOD_KEY` is not
    passed to its class."""
    if key == "algorithm" and isinstance(node, DictConfig) and METHOD_KEY in node:
        try:  # resolved where it stands (its interpolations may point outside it)
            node = OmegaConf.to_container(node, resolve=True)
        except Exception as e:
            raise ConfigError(key, f"{e.__class__.__name__}: {e}") from None
        node.pop(METHOD_KEY)
    try:
        return instantiate(node, **kwargs)
    except InstantiationException as e:
        cause = e.__cause__
        while cause is not None:
            if isinstance(cause, FedLightningError):
                raise cause from None
            cause = cause.__cause__
        root = e.__cause__ or e
        raise ConfigError(key, f"{root.__class__.__name__}: {root}") from None
    except FedLightningError:
        raise
    except Exception as e:
        raise ConfigError(key, f"{e.__class__.__name__}: {e}") from None
