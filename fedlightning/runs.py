"""The run wrapper every kind of run goes through (graph federations, FedTIP's task
protocol, the bank, ``data manifest``): the run directory and resume
(:func:`prepare_run_dir`), the MLflow run (:meth:`Run.start`), ``summary.json``, final
metrics, artifacts and console table (:meth:`Run.finish`), and the run identity that a
resume checks (:func:`run_identity`, :func:`load_checkpoint`; docs/architecture.md)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import pickle
import shutil
import time
import zipfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from fedlightning.errors import ConfigError, FedLightningError, RunStopped
from fedlightning.tracking import MlflowTracker, NullTracker, flatten
from fedlightning.tracking.mlflow_tracker import run_name
from fedlightning.utils.io import content_hash, write_json

# Checkpoint formats: 1 (no ``format`` key, graph runs; ledger entries without scope), 2
# (entries carry a scope: FedTIP's tasks), 3 (the run's ``identity``, which a resume checks).
# Schedules write CHECKPOINT_FORMAT; a resume reads any of CHECKPOINT_FORMATS_READ.
CHECKPOINT_FORMAT = 3
CHECKPOINT_FORMATS_READ = (1, 2, 3)

CONFIG_FILE, CHECKPOINT_FILE, SUMMARY_FILE = "config.yaml", "checkpoint.pt", "summary.json"
MLFLOW_RUN_FILE, IDENTITY_FILE = "mlflow_run.json", "identity.json"
LOCK_FILE = "run.lock"  # held (flock) by the process whose run owns the directory
# observe(kind, step, metrics): see fedlightning.train.train
Observer = Callable[[str, int, dict[str, float]], None]
# What a resume may change without changing the run (how and where it runs, not what).
RESUMABLE_KEYS = (
    "runner",
    "trainer",
    "logger",
    "resume",
    "hydra",
    "threads",
    "task_workers",
    "plots",
)
# Any failure to unpickle a file that is not a torch checkpoint.
_UNREADABLE = (
    pickle.UnpicklingError,
    zipfile.BadZipFile,
    EOFError,
    OSError,
    RuntimeError,
    ValueError,
)


def _reason(e: BaseException) -> str:
    """The first line of an exception's message, else its type's name."""
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def load_saved_config(path: Path) -> DictConfig:
    """A run's saved ``config.yaml``; one line naming the file if it is not a run's config."""
    try:
        saved = OmegaConf.load(path)
    except Exception as e:  # YAML syntax, bad encoding, an unreadable file
        raise FedLightningError(
            f"{path}: not a readable run config ({_reason(e)}); restore it or start a new run"
        ) from None
    if not isinstance(saved, DictConfig) or "name" not in saved or "task" not in saved:
        raise FedLightningError(
            f"{path}: not a run's config (a mapping with `name` and `task` was expected); "
            "restore it or start a new run"
        )
    return saved


def trained_config(cfg: DictConfig) -> DictConfig:
    """The config the run trains: ``cfg``, or on ``resume=DIR`` the saved run's."""
    saved = Path(str(cfg.get("resume") or "")) / CONFIG_FILE
    return load_saved_config(saved) if cfg.get("resume") and saved.is_file() else cfg


def apply_threads(setting: Any) -> int:
    """Set torch's intra-op threads of this process from the run's ``threads`` and return
    them: a positive number, or ``auto``: torch's default (the cores, or
    ``OMP_NUM_THREADS``), divided among the processes that share this machine
    (``LOCAL_WORLD_SIZE`` of torchrun) when ``OMP_NUM_THREADS`` is unset."""
    if setting is None or setting == "auto":
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if local > 1 and "OMP_NUM_THREADS" not in os.environ:
            cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
            torch.set_num_threads(max(1, (cpus or os.cpu_count() or 1) // local))
        return torch.get_num_threads()
    if isinstance(setting, bool) or not isinstance(setting, int) or setting < 1:
        raise ConfigError("threads", f"expected a positive integer or 'auto', got {setting!r}")
    torch.set_num_threads(setting)
    return setting


def feature_hashes(features: dict[str, torch.Tensor]) -> dict[str, str]:
    """A content hash of each modality's feature matrix (sha256 of its shape, dtype and
    values; a sparse one's coalesced indices and values), 16 hex characters: computed once,
    when the data is loaded, so that a resume on changed features is refused."""
    out = {}
    for m, x in features.items():
        h = hashlib.sha256(f"{tuple(x.shape)} {x.dtype}".encode())
        parts = [x.coalesce().indices(), x.coalesce().values()] if x.is_sparse else [x]
        for t in parts:
            h.update(t.detach().cpu().contiguous().numpy())  # its buffer: no bytes copy
        out[str(m)] = h.hexdigest()[:16]
    return out


def run_identity(
    cfg: DictConfig, hashes: dict[str, str], features: dict[str, str] | None = None
) -> dict[str, Any]:
    """What a run is: its experiment, the hash of its resolved config less the keys a
    resume may change (:data:`RESUMABLE_KEYS`), a short hash per config key (to name the
    first that differs), its protocol ``hashes`` and, where given, the content hash of each
    modality's ``features`` (:func:`feature_hashes`)."""
    resolved = OmegaConf.to_container(cfg, resolve=True)
    kept = {k: v for k, v in resolved.items() if k not in RESUMABLE_KEYS}
    keys = {k: content_hash(v)[:8] for k, v in sorted(flatten(kept).items())}
    identity = {
        "experiment": str(cfg.name),
        "config": content_hash(kept),
        "config_keys": keys,
        "hashes": {k: str(v) for k, v in sorted(hashes.items())},
    }
    if features is not None:
        identity["features"] = dict(sorted(features.items()))
    return identity


def identity_mismatch(found: dict[str, Any], expected: dict[str, Any]) -> str | None:
    """What differs between two run identities (``None``: the same run)."""
    if found.get("experiment") != expected["experiment"]:
        return f"experiment {found.get('experiment')!r}, this run is {expected['experiment']!r}"
    if found.get("config") != expected["config"]:
        old, new = found.get("config_keys") or {}, expected["config_keys"]
        diff = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
        first = f", first at `{diff[0]}`" if diff else ""
        return f"config hash {found.get('config')} != {expected['config']}{first}"
    old_h, new_h = found.get("hashes") or {}, expected["hashes"]
    for name in sorted(old_h.keys() | new_h.keys()):
        if old_h.get(name) != new_h.get(name):
            return f"{name} hash {old_h.get(name)} != {new_h.get(name)}"
    old_f, new_f = found.get("features"), expected.get("features")
    if isinstance(old_f, dict) and isinstance(new_f, dict):  # an older run has none
        for m in sorted(old_f.keys() | new_f.keys()):
            if old_f.get(m) != new_f.get(m):
                return (
                    f"modality `{m}`: features hash {old_f.get(m)} != {new_f.get(m)} "
                    "(its feature file changed)"
                )
    return None


def record_identity(run_dir: Path, identity: dict[str, Any], resuming: bool) -> None:
    """Write ``identity.json``; on resume first refuse (one line) a directory whose saved
    identity is another run's (a run directory of an older version has none: written now)."""
    path = run_dir / IDENTITY_FILE
    if resuming and path.is_file():
        try:
            saved = json.loads(path.read_text())
        except (ValueError, UnicodeDecodeError):
            raise FedLightningError(
                f"{path}: not readable JSON; restore it or start a new run"
            ) from None
        diff = identity_mismatch(saved if isinstance(saved, dict) else {}, identity)
        if diff:
            raise FedLightningError(f"{path}: belongs to another run ({diff}); refusing to resume")
        return
    write_json(path, identity)


def check_protocol(path: Path, key: str, value: Any) -> None:
    """On resume: refuse (one line) when the saved protocol file ``path`` holds another
    ``key`` than ``value``, what the same config gives now (the data or code changed)."""
    saved = json.loads(path.read_text()).get(key)
    if saved != value:
        raise FedLightningError(
            f"{path}: the run was started with protocol {key} {saved}, but the same config "
            f"now gives {value} (data or code changed); refusing to resume"
        )


def check_resume_dir(old: Path) -> None:
    """Refuse (one line naming ``resume``) a ``resume`` directory that holds no run's
    ``config.yaml`` or whose run already finished: checked before anything is written."""
    if not (old / CONFIG_FILE).is_file():
        raise ConfigError(
            "resume", f"{old} holds no {CONFIG_FILE}; pass an earlier run's directory"
        )
    if (old / SUMMARY_FILE).exists():
        raise ConfigError(
            "resume", f"{old} already finished ({SUMMARY_FILE} exists); nothing to resume"
        )


def refuse_existing_run(run_dir: Path) -> None:
    """Refuse (one line) a fresh run in a directory that already holds a run (its
    ``summary.json`` or ``checkpoint.pt``): checked before anything is written there."""
    for name in (SUMMARY_FILE, CHECKPOINT_FILE):
        if (run_dir / name).exists():
            raise FedLightningError(
                f"run directory {run_dir} already holds a run ({name}); "
                "refusing to overwrite it: choose a new hydra.run.dir or "
                f"resume={run_dir}"
            )


# resolved run directory -> the held lock file's descriptor, and its path where this
# process made the file (removed on release)
_HELD: dict[str, tuple[int, Path | None]] = {}


def lock_run_dir(run_dir: Path) -> None:
    """Hold ``run_dir``'s lock (``run.lock``, an exclusive ``flock``) for this process's run,
    creating the directory if needed; refuse in one line when another process holds it (a
    run in progress there). :func:`release_run_dirs` releases the lock and removes the file
    it made; the operating system releases it when the process ends, killed or not (a
    killed run's file stays, unlocked). Taken twice by one process: once. Where the
    directory cannot be made or ``fcntl`` does not exist, nothing is locked."""
    key = str(Path(run_dir).resolve())
    if key in _HELD:
        return
    try:
        import fcntl
    except ImportError:  # not a POSIX system: no lock
        return
    path = Path(run_dir) / LOCK_FILE
    while True:
        try:
            Path(run_dir).mkdir(parents=True, exist_ok=True)
            found = path.exists()  # a killed run's file: used as it is, and left there
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:  # under a file, unwritable: the run's own setup names the folder
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise FedLightningError(
                f"run directory {run_dir} is in use by another run (process {holder}); "
                "choose a new hydra.run.dir, or wait for it and resume"
            ) from None
        try:  # the holder before may have removed the file between our open and our lock
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    if not found:
        os.write(fd, f"{os.getpid()}\n".encode())
    _HELD[key] = (fd, None if found else path)


def release_run_dirs(keep: Iterable[str] = ()) -> None:
    """Release the run-directory locks this process holds, but those in ``keep``: each lock
    file this process made is removed (a refused run leaves its folder as it found it)."""
    for key in [k for k in _HELD if k not in set(keep)]:
        fd, path = _HELD.pop(key)
        if path is not None:  # made by this process: removed
            with contextlib.suppress(OSError):
                path.unlink()
        os.close(fd)


@contextlib.contextmanager
def holding_run_dirs() -> Iterator[None]:
    """Release, on the way out, the run-directory locks taken inside (one run's), so that
    the same process can run (or resume) in them afterwards."""
    before = set(_HELD)
    try:
        yield
    finally:
        release_run_dirs(keep=before)


def drop_stub_run_dir(run_dir: Path) -> bool:
    """Remove the folder a refused fresh run left (Hydra's ``.hydra`` and log, the lock,
    the saved config): only when no other run holds it and it holds no checkpoint and no
    summary. Whether it was removed."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir() or any((run_dir / n).exists() for n in (CHECKPOINT_FILE, SUMMARY_FILE)):
        return False
    try:
        lock_run_dir(run_dir)
    except FedLightningError:  # another run's folder
        return False
    root = logging.getLogger()
    for h in [h for h in root.handlers if isinstance(h, logging.FileHandler)]:
        if Path(h.baseFilename).resolve().is_relative_to(run_dir.resolve()):
            root.removeHandler(h)  # Hydra's log of this invocation, open in the folder
            h.close()
    release_run_dirs(keep=[k for k in _HELD if k != str(run_dir.resolve())])
    shutil.rmtree(run_dir, ignore_errors=True)
    return not run_dir.exists()


def prepare_run_dir(cfg: DictConfig, run_dir: Path) -> tuple[DictConfig, Path, bool]:
    """The config and directory to run in, and whether it resumes: on ``resume`` the earlier
    run's own (its saved config, with this invocation's ``runner``, ``logger``, ``threads``
    and ``plots``); a fresh run refuses a directory that already holds a run. Either way
    the directory's lock is taken first (:func:`lock_run_dir`): one another run is using is
    refused."""
    if cfg.get("resume"):
        old = Path(cfg.resume)
        check_resume_dir(old)
        lock_run_dir(old)
        saved = load_saved_config(old / CONFIG_FILE)
        saved.runner, saved.logger = cfg.runner, cfg.logger
        if "trainer" in cfg:  # where the local fits run: the resuming invocation's, as runner
            saved.trainer = cfg.trainer
        saved.threads = cfg.get("threads", "auto")
        saved.plots = cfg.get("plots", True)
        saved.resume = str(old)
        return saved, old, True
    refuse_existing_run(run_dir)  # before the lock: a folder holding a run stays untouched
    lock_run_dir(run_dir)  # a second run started at the same time is refused here
    refuse_existing_run(run_dir)  # (one that finished before we held the lock)
    run_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, run_dir / CONFIG_FILE, resolve=True)
    return OmegaConf.load(run_dir / CONFIG_FILE), run_dir, False


def load_checkpoint(path: Path, identity: dict[str, Any] | None = None) -> dict[str, Any]:
    """The checkpoint at ``path``; one line naming the file if it is not a torch file, its
    format is unknown or (given this run's ``identity``) it is another run's. A checkpoint
    written before runs had an identity (formats 1 and 2) still resumes."""
    try:
        state = torch.load(path, weights_only=False)
    except _UNREADABLE as e:
        raise FedLightningError(
            f"{path}: not a readable checkpoint ({_reason(e)[:120]}); start a new run"
        ) from None
    version = state.get("format", 1) if isinstance(state, dict) else None
    if version not in CHECKPOINT_FORMATS_READ:
        raise FedLightningError(
            f"{path}: checkpoint format {version!r} is not one this version reads "
            f"({', '.join(map(str, CHECKPOINT_FORMATS_READ))}); start a new run"
        )
    found = state.get("identity")
    if identity is not None and isinstance(found, dict):
        diff = identity_mismatch(found, identity)
        if diff:
            raise FedLightningError(
                f"{path}: a checkpoint of another run ({diff}); refusing to resume"
            )
    return state


def resume_loop(
    loop: Any,
    world: Any,
    cfg: DictConfig,
    run_dir: Path,
    hashes: dict[str, str],
    resuming: bool,
    load: Callable[..., dict[str, Any] | None] = load_checkpoint,
    features: dict[str, str] | None = None,
) -> bool:
    """Give ``loop`` this run's identity (with the modalities' ``features`` hashes, where
    given); on resume restore it from the checkpoint that ``load(path, identity)`` reads
    (another run's, one on other features, or one that does not fit, is refused); then
    record ``identity.json``. Whether a checkpoint was restored."""
    loop.identity = identity = run_identity(cfg, hashes, features)
    path = run_dir / CHECKPOINT_FILE
    state = world.on_main(load, path, identity) if resuming else None
    if state is not None:
        restore(loop, path, state)
    world.on_main(record_identity, run_dir, identity, resuming)
    return state is not None


def _shapes(obj: Any, prefix: str = "") -> dict[str, tuple[int, ...]]:
    """The shape of every tensor in a nested state, by its dotted path."""
    if isinstance(obj, torch.Tensor):
        return {prefix: tuple(obj.shape)}
    items = (
        obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    )
    out: dict[str, tuple[int, ...]] = {}
    for k, v in items:
        out.update(_shapes(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def restore(loop: Any, path: Path, state: dict[str, Any]) -> None:
    """``loop.load_state_dict(state)``; one line naming ``path`` if the state does not fit the
    loop (a checkpoint of another model: its global model's shapes differ; or a partial one).
    The server modules' states (prototype banks, bases) grow as a run goes: not compared."""
    server = getattr(loop, "server", None)
    if server is not None and isinstance(state, dict) and "server" in state:
        ours = _shapes(server.state_dict()["global_state"])
        theirs = _shapes(state["server"].get("global_state", {}))
        for key in sorted(ours.keys() & theirs.keys()):
            if ours[key] != theirs[key]:
                raise FedLightningError(
                    f"{path}: a checkpoint of another model (`{key}` has shape "
                    f"{list(theirs[key])}, this run's {list(ours[key])}); refusing to resume"
                )
    try:
        loop.load_state_dict(state)
    except (KeyError, RuntimeError, ValueError, TypeError, IndexError, AttributeError) as e:
        raise FedLightningError(
            f"{path}: does not fit this run's model and clients ({type(e).__name__}: "
            f"{_reason(e)[:160]}); refusing to resume"
        ) from None


def run_tags(cfg: Any, hashes: dict[str, str], **tags: str) -> dict[str, str]:
    """``tags`` (method, dataset, task, variant, backbone, ...) with the seed, the experiment
    and ``hash_<name>`` per protocol hash: the MLflow tags that ``fedlightning report``
    selects runs by (docs/experiments.md, "Reports")."""
    hashed = {f"hash_{k}": v for k, v in hashes.items()}
    return {**tags, "seed": str(cfg.seed), "experiment": str(cfg.name), **hashed}


def json_safe(obj: Any) -> Any:
    """Non-finite floats as null, so summary.json and history.json stay strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def summary_table(rows: list[tuple[str, Any]], summary: dict[str, Any]) -> str:
    """``rows`` then the hashes, wall time and run directory, as an aligned table."""
    rows = rows + [(f"hash[{k}]", v) for k, v in summary.get("hashes", {}).items()]
    rows += [("wall time", f"{summary['wall_time_s']:.1f} s"), ("run dir", summary["run_dir"])]
    width = max(len(k) for k, _ in rows)
    line = "-" * (width + 40)
    return "\n".join([line, *(f"{k:<{width}}  {v}" for k, v in rows), line])


def peak_rss_mib() -> float:
    """This process's peak resident memory so far, in MiB (``ru_maxrss``: KiB on Linux)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class Run:
    """One run of any kind in ``run_dir``, with ``cfg`` from :func:`prepare_run_dir`;
    ``is_main``: this process writes and logs (rank 0 of a distributed run)."""

    def __init__(self, cfg: Any, run_dir: Path, is_main: bool = True, resuming: bool = False):
        self.cfg, self.run_dir, self.is_main, self.resuming = cfg, Path(run_dir), is_main, resuming
        self.tracker = NullTracker()
        if is_main and cfg.logger.get("enabled", True):
            self.tracker = MlflowTracker(cfg.logger.tracking_uri, cfg.logger.experiment_name)
        self.tags: dict[str, str] = {}

    def start(
        self,
        tags: dict[str, str],
        name: str | None = None,
        params: Any = None,
        record_id: bool = True,
    ) -> Run:
        """Start (or, on resume, continue) the MLflow run with ``tags`` and ``params``
        (default: the resolved config); record its id in the run directory (``record_id``).
        Its name (default): ``<method>-<data>-s<seed>`` within the runs table's width
        (:func:`~fedlightning.tracking.mlflow_tracker.run_name`); its folder is the tag
        ``run_dir``."""
        self.tags = dict(tags)
        run_id = None
        saved = self.run_dir / MLFLOW_RUN_FILE
        if self.is_main and self.resuming and saved.exists():
            run_id = json.loads(saved.read_text())["run_id"]
        parent = self.cfg.logger.get("parent_run_id")  # a sweep trial's runs nest under it
        mlflow_tags = {**self.tags, "run_dir": str(self.run_dir.resolve())}
        if parent:
            mlflow_tags["mlflow.parentRunId"] = str(parent)
        if params is None:
            params = flatten(OmegaConf.to_container(self.cfg, resolve=True))
        params = {**params, "threads_used": torch.get_num_threads()}
        from fedlightning.config import run_label  # (Hydra only when a run starts)

        method = self.tags.get("method") or str(self.cfg.name)
        name = name or run_name(method, run_label(self.cfg), self.cfg.seed)
        try:
            run_id = self.tracker.start(name, mlflow_tags, params, run_id=run_id)
        except FedLightningError:
            raise
        except Exception as e:  # the store's URI, path or database: before any training
            uri = self.cfg.logger.get("tracking_uri")
            raise ConfigError(
                "logger.tracking_uri",
                f"MLflow cannot open the store {uri!r} ({type(e).__name__}: "
                f"{_reason(e)[:200]}); fix the URI or run with logger=none",
            ) from None
        if run_id and self.is_main and record_id:
            write_json(saved, {"run_id": run_id, "tracking_uri": self.cfg.logger.tracking_uri})
        return self

    def __enter__(self) -> Run:
        return self

    def __exit__(self, kind: type | None, err: BaseException | None, tb: Any) -> None:
        if err is not None:
            self.tracker.end("KILLED" if isinstance(err, RunStopped) else "FAILED")

    def summary(self, t0: float, **fields: Any) -> dict[str, Any]:
        """``fields`` with the run's experiment, seed, tags, directory and wall time since
        ``t0`` (a ``time.perf_counter()``)."""
        return {
            "experiment": str(self.cfg.name),
            "seed": int(self.cfg.seed),
            **fields,
            "wall_time_s": time.perf_counter() - t0,
            "peak_rss_mib": peak_rss_mib(),
            "run_dir": str(self.run_dir),
            "tags": self.tags,
        }

    def finish(
        self,
        summary: dict[str, Any],
        *,
        step: int,
        files: Iterable[Path] = (),
        table: Callable[[dict[str, Any]], str] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Write ``summary.json`` (and ``extra`` JSON files by name), log the final metrics
        at ``step`` and ``files`` as artifacts, end the MLflow run, print ``table(summary)``."""
        summary = json_safe({**summary, "threads": torch.get_num_threads()})
        if not self.is_main:  # the same state on every rank; rank 0 writes and logs it
            return summary
        written = []
        for name, obj in (extra or {}).items():
            write_json(self.run_dir / name, json_safe(obj))
            written.append(self.run_dir / name)
        write_json(self.run_dir / SUMMARY_FILE, summary)
        metrics = summary.get("metrics", {})
        # once, at the last step, in the MLflow UI's own chart section (docs/experiments.md)
        self.tracker.log_metrics({f"final/{k}": v for k, v in metrics.items()}, step=step)
        if "peak_rss_mib" in summary:  # the process's memory high-water mark (docs/scaling.md)
            self.tracker.log_metrics({"final/peak_rss_mib": summary["peak_rss_mib"]}, step=step)
        if summary.get("timing"):  # seconds per round and the like, next to the metrics
            self.tracker.log_metrics(
                {f"final/{k}": v for k, v in summary["timing"].items()}, step=step
            )
        files = [self.run_dir / CONFIG_FILE, self.run_dir / SUMMARY_FILE, *written, *files]
        self.tracker.log_artifacts([f for f in dict.fromkeys(files) if Path(f).exists()])
        self.tracker.end("FINISHED")
        if table is not None:
            print(table(summary), flush=True)
        return summary
