"""Command line: ``fedlightning train [overrides]`` (Hydra; ``-m`` for multirun)."""

from __future__ import annotations

import argparse
import contextlib
import difflib
import logging
import os
import re
import sys
import time
from collections import Counter
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, ListConfig, OmegaConf

from fedlightning.config import CONF_DIR, compose, run_label
from fedlightning.errors import ConfigError, FedLightningError
from fedlightning.recipes import composed_form

USAGE = """usage: fedlightning COMMAND [hydra overrides]   (fedlightning --version)

commands:
  train     run an experiment: fedlightning train experiment=fl_cora algorithm=fedavg federation.rounds=20
            multirun:          fedlightning train -m seed=0,1,2
            resume:            fedlightning train resume=outputs/<data>/<experiment>/<run>
            show the config:   fedlightning train --cfg job
  sweep     run (or resume) an Optuna study: fedlightning sweep sweeps/fedprox_mu_cora.yaml
            options: --trials N --storage URI --study NAME --out DIR, then Hydra overrides
            for every run (e.g. federation.rounds=5)
            dashboard: fedlightning sweep dashboard sweeps/fedprox_mu_cora.yaml
  report    tables and plots from MLflow runs: fedlightning report --task cil --out reports/
            (fedlightning report --help for the layouts and filters)
  flower-sim  the experiment as a Flower app in Flower's simulation engine (runner=flower):
            fedlightning flower-sim experiment=fl_cora algorithm=fedavg [--run-dir DIR]
            resume:  fedlightning flower-sim resume=outputs/<data>/<experiment>/<run>
            a real deployment: flwr run tools/flower (docs/scaling.md)
  data features RAW --out DIR
            encode raw node texts and images into a dataset folder (dataset=folder):
            fedlightning data features my_raw_graph --out my_graph (--help for options)
  data manifest [--out DIR] [hydra overrides]
            materialize FedTIP's protocol objects and print the manifest table:
            fedlightning data manifest experiment=temporal_wikipedia
  completion bash|zsh
            tab completion of commands and overrides (add to ~/.bashrc or ~/.zshrc):
            eval "$(fedlightning completion bash)"
"""


# Lightning's DDP launcher (runner.executor.devices > 1, strategy ddp) re-executes
# `sys.executable` + `sys.argv` for ranks 1..N-1 at the first local fit, appending
# `hydra.run.dir=<this run's dir> hydra.job.name=train_ddp_process_<rank>
# hydra.output_subdir=null`: the ranks share rank 0's (time-stamped) run directory.
LIGHTNING_RANK_JOB = "train_ddp_process_"
LIGHTNING_RANK_ARG = f"hydra.job.name={LIGHTNING_RANK_JOB}"
_relaunch_argv: list[str] = []  # the command line that starts `fedlightning train` again


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="train")
def _train(cfg: DictConfig) -> float:
    from hydra.types import RunMode
    from omegaconf.errors import InterpolationResolutionError, MissingMandatoryValue
    from tqdm.contrib.logging import logging_redirect_tqdm

    from fedlightning.train import train

    hydra_cfg = HydraConfig.get()
    try:
        _show_user_errors_as_set()  # the task's children see the user's HYDRA_FULL_ERROR
        ranks = lightning_ranks(cfg)
        check_lightning_ddp(cfg, "multirun (-m)" if hydra_cfg.mode == RunMode.MULTIRUN else None)
        if hydra_cfg.job.name.startswith(LIGHTNING_RANK_JOB):
            summary = _train_lightning_rank(cfg)
        else:
            if ranks > 1 and _relaunch_argv:
                sys.argv = list(_relaunch_argv)
            started = time.monotonic()
            try:
                with logging_redirect_tqdm():  # log lines above a progress bar, never into it
                    summary = train(cfg, hydra_cfg.runtime.output_dir)
            finally:
                if ranks > 1:  # they do this run's work: as long as it took, at least
                    _wait_for_lightning_ranks(max(60.0, time.monotonic() - started))
    except (FedLightningError, InterpolationResolutionError, MissingMandatoryValue) as e:
        _drop_resume_scratch(cfg, hydra_cfg.runtime.output_dir)
        if _fresh_dir[0] and not cfg.get("resume"):  # a refused fresh run leaves no folder
            from fedlightning.runs import drop_stub_run_dir

            drop_stub_run_dir(Path(hydra_cfg.runtime.output_dir))
        sys.exit(_error(str(e) if isinstance(e, FedLightningError) else hydra_error_line(e)))
    finally:
        os.environ[_FULL_ERROR] = "1"  # Hydra's own errors after the task: raised to main
    metrics = summary["metrics"]
    objective = metrics.get("val_am", metrics.get("val_acc"))  # what a sweep optimizes
    return float("nan") if objective is None else float(objective)


def lightning_ranks(cfg: DictConfig) -> int:
    """How many processes Lightning's launcher runs each local fit in: ``runner.executor``'s
    devices for a ``TrainerExecutor`` whose strategy re-executes the command (``ddp``,
    ``auto``, ...; not ``ddp_spawn``/``ddp_fork``/``ddp_notebook``), else 1."""
    executor = OmegaConf.select(cfg, "runner.executor") or {}
    if not str(executor.get("_target_", "")).endswith(".TrainerExecutor"):
        return 1
    if any(s in str(executor.get("strategy", "auto")) for s in ("spawn", "fork", "notebook")):
        return 1
    devices = executor.get("devices", 1)
    if isinstance(devices, (list, ListConfig)):
        return len(devices)
    text = str(devices).strip()
    if "," in text:
        return len([d for d in text.split(",") if d.strip()])
    if text.isdigit():
        return int(text)
    if executor.get("accelerator", "cpu") == "cpu":  # "auto" or -1 on the CPU: one process
        return 1
    import torch

    return torch.cuda.device_count()  # "auto" or -1: every visible GPU


def check_lightning_ddp(cfg: DictConfig, context: str | None = None) -> None:
    """Refuse a Lightning DDP fit (``runner.executor.devices`` > 1) that its launcher cannot
    start again as the other ranks of this run: ``context`` names a caller that trains
    several configs in one process (multirun, a sweep)."""
    if lightning_ranks(cfg) <= 1:
        return
    field = "runner.executor.devices"
    if context is not None:
        raise ConfigError(field, f"> 1 (Lightning DDP) does not combine with {context}")
    if str(OmegaConf.select(cfg, "runner._target_", default="")).endswith(".DistributedRunner"):
        raise ConfigError(
            field,
            "> 1 (Lightning DDP) does not combine with runner=distributed, whose ranks fit "
            "on one device each; use runner=sequential_trainer",
        )


def _train_lightning_rank(cfg: DictConfig) -> dict:
    """A rank Lightning's DDP launcher started: the same federated loop, so that every local
    fit has its partner, in a scratch directory (rank 0 alone writes the run directory,
    logs and prints); with ``resume``, from a copy of the run's checkpoint."""
    import shutil
    import tempfile

    from fedlightning.runs import MLFLOW_RUN_FILE
    from fedlightning.train import train

    root = logging.getLogger()
    for h in [h for h in root.handlers if isinstance(h, logging.FileHandler)]:
        root.removeHandler(h)  # Hydra's train_ddp_process_<rank>.log in rank 0's directory
        h.close()
        Path(h.baseFilename).unlink(missing_ok=True)
    logging.getLogger("fedlightning").setLevel(logging.WARNING)
    OmegaConf.update(cfg, "logger.enabled", False, force_add=True)
    OmegaConf.update(cfg, "runner.progress", False, force_add=True)
    with tempfile.TemporaryDirectory(prefix="fedlightning-rank-") as scratch:
        run_dir = Path(scratch) / "run"
        if cfg.get("resume"):
            ignore = shutil.ignore_patterns(".resume", MLFLOW_RUN_FILE)
            shutil.copytree(cfg.resume, run_dir, ignore=ignore)
            cfg.resume = str(run_dir)
        return train(cfg, run_dir, verbose=False)


def _wait_for_lightning_ranks(timeout_s: float = 60.0) -> None:
    """Wait for the ranks Lightning started (they end with the loop), so none outlives the
    command; kill any still running after ``timeout_s`` (the caller's: rank 0's run time)."""
    import psutil  # a dependency of torch-geometric

    ranks = [
        p
        for p in psutil.Process().children()
        if any(a.startswith(f"hydra.job.name={LIGHTNING_RANK_JOB}") for a in p.cmdline())
    ]
    _, alive = psutil.wait_procs(ranks, timeout=timeout_s)
    for p in alive:
        print(f"warning: killing Lightning rank process {p.pid}", file=sys.stderr, flush=True)
        p.kill()


def _resume_run_dir(args: list[str]) -> list[str]:
    """On ``resume=DIR``, keep the resuming invocation's Hydra files inside ``DIR/.resume``."""
    _resume_scratch[0] = False
    resume = next((a for a in args if a.startswith("resume=") and a != "resume=null"), None)
    if resume is None:
        return args
    kept = ("resume=", "runner", "trainer", "logger", "hydra")
    ignored = [a for a in args if not a.startswith(kept)]
    if ignored:
        print(
            f"warning: a resumed run keeps its saved config; ignoring {' '.join(ignored)} "
            "(only runner.*, trainer.* and logger.* may change)",
            file=sys.stderr,
        )
    if any(a.startswith("hydra.run.dir=") for a in args):
        return args
    folder = resume.split("=", 1)[1]
    _resume_scratch[0] = _checkpoint_stamp(Path(folder))
    return [*args, f"hydra.run.dir={folder}/.resume/${{now:%Y-%m-%d_%H-%M-%S-%f}}"]


def _checkpoint_stamp(run_dir: Path) -> tuple[int, int] | None:
    """``run_dir/checkpoint.pt``'s size and modification time (``None``: no such file)."""
    try:
        st = (run_dir / "checkpoint.pt").stat()
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns


def _drop_resume_scratch(cfg: DictConfig, output_dir: str) -> None:
    """A refused resume leaves nothing in the run it refused: remove the folder this
    invocation made for its Hydra files (``DIR/.resume/<time>``), and ``.resume`` if empty.
    A resume that trained (its checkpoint moved on) before it failed keeps its log there."""
    if _resume_scratch[0] is False or not cfg.get("resume"):
        return
    if _checkpoint_stamp(Path(cfg.resume)) != _resume_scratch[0]:
        return
    import shutil

    out = Path(output_dir).resolve()
    if out.parent.name != ".resume":
        return
    root = logging.getLogger()
    for h in [h for h in root.handlers if isinstance(h, logging.FileHandler)]:
        if Path(h.baseFilename).resolve().is_relative_to(out):
            root.removeHandler(h)
            h.close()
    shutil.rmtree(out, ignore_errors=True)
    with contextlib.suppress(OSError):
        out.parent.rmdir()  # only when empty: earlier resumes' files stay


def _override(args: list[str], key: str) -> str | None:
    """The value the command line's last ``key=VALUE`` override gives (``None``: none)."""
    values = [a.split("=", 1)[1] for a in args if a.startswith(f"{key}=")]
    return values[-1] if values else None


def _resolved_run_dir(args: list[str]) -> str | None:
    """``hydra.run.dir`` as Hydra will resolve it for ``args`` (``None``: it does not
    resolve; Hydra reports that itself)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    try:
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
            cfg = hydra_compose("train", overrides=args, return_hydra_config=True)
            HydraConfig.instance().set_config(cfg)
            return str(OmegaConf.select(cfg, "hydra.run.dir"))
    except Exception:
        return None


def _refuse_before_hydra(args: list[str]) -> None:
    """Refuse, before Hydra creates or writes anything (its ``.hydra`` files, its log), what
    the run wrapper would refuse anyway: ``resume=DIR`` of a folder that holds no run or a
    finished one, and a fresh run whose ``hydra.run.dir`` already holds a run. Hydra's own
    modes (``--cfg``, ``--info``, ...) and the ranks Lightning starts are left to the run; a
    multirun (``-m``) into a ``hydra.sweep.dir`` whose job folders hold a run is refused.
    :mod:`fedlightning.runs` (and so torch) is imported only where there is a folder to check."""
    flags = {a for a in args if a.startswith("-")}
    if flags - {"-m", "--multirun"} or any(a.startswith(LIGHTNING_RANK_ARG) for a in args):
        return
    if flags:  # a multirun: its jobs' folders <hydra.sweep.dir>/<job number>
        sweep_dir = _override(args, "hydra.sweep.dir")
        if sweep_dir is not None and "${" not in sweep_dir and Path(sweep_dir).is_dir():
            from fedlightning.runs import refuse_existing_run

            for job in sorted(p for p in Path(sweep_dir).iterdir() if p.is_dir()):
                refuse_existing_run(job)
        return
    resume = _override(args, "resume")
    if resume not in (None, "null", ""):
        from fedlightning.runs import check_resume_dir

        check_resume_dir(Path(resume))
        return
    run_dir = _override(args, "hydra.run.dir")
    if run_dir is not None and "${" in run_dir:
        run_dir = _resolved_run_dir(args)
    main_rank = os.environ.get("RANK", "0") == "0"  # torchrun's other ranks share the folder
    _fresh_dir[0] = main_rank and (run_dir is None or not Path(run_dir).exists())
    _named_dir[0] = None if run_dir is None or not main_rank else Path(run_dir)
    if run_dir is not None:  # else outputs/<data>/<experiment>/<time>: a new folder
        from fedlightning.runs import lock_run_dir, refuse_existing_run, release_run_dirs

        refuse_existing_run(Path(run_dir))
        if main_rank:  # before Hydra writes there: a folder a run is using is refused
            lock_run_dir(Path(run_dir))
            try:
                refuse_existing_run(Path(run_dir))  # one that finished while we waited
            except FedLightningError:
                release_run_dirs()
                raise


def _missing_option_line(e: Exception) -> str:
    """``group=option`` of no config file: the group, the option and Hydra's options (the
    close ones first)."""
    found = re.search(r"Could not (?:find|load) '([^']+)'", str(e))
    group, _, option = (found.group(1) if found else "").rpartition("/")
    options = [str(o) for o in (getattr(e, "options", None) or [])]
    if not group or not options:
        return _compact(e)
    renamed = composed_form(option, CONF_DIR) if group == "experiment" else None
    if renamed:
        return (
            f"config `experiment`: {option!r} is now an experiment per protocol and dataset, "
            f"the method chosen apart: {' '.join(renamed)}"
        )
    close = difflib.get_close_matches(option, options, n=3, cutoff=0.6)
    if close:
        hint = f"did you mean {' or '.join(close)}?"
    elif len(options) <= 8:
        hint = f"one of {', '.join(options)}"
    else:
        hint = f"one of the {len(options)} files of conf/{group}/"
    return f"config `{group}`: no option {option!r} ({hint})"


_NOISE = ("Available options", "Config search path", "full_key:", "object_type=", "reference_type=")


def _compact(e: BaseException) -> str:
    """Hydra's or OmegaConf's message, and its cause's, on one line; an override Hydra could
    not apply names its key first, with Hydra's hint (``+key=...`` to add a key)."""
    lines: list[str] = []
    for err in (e, e.__cause__):
        if err is None:
            continue
        for line in str(err).splitlines():
            line = line.strip()
            if line.startswith(_NOISE):
                break
            if line and not line.startswith(("^", "See https://")) and line not in lines:
                lines.append(line)
    if not lines:
        return type(e).__name__
    override = getattr(e, "override", None)  # an override Hydra cannot parse
    if override:
        return f"override {override!r}: " + "; ".join(lines)
    key = re.match(r"Could not (?:override|append to config\.) '?([^'\s]+?)'?\.?$", lines[0])
    if key:
        hints = [ln for ln in lines[1:] if ln.startswith("To ")]
        said = [ln for ln in lines[1:] if not ln.startswith("To ")] or ["could not be set"]
        return f"config `{key.group(1)}`: " + "; ".join(said + _close_keys(key.group(1)) + hints)
    full_key = getattr(e, "full_key", None)
    if full_key:
        return f"config `{full_key}`: " + "; ".join(lines)
    return "; ".join(lines)


def _close_keys(key: str) -> list[str]:
    """``did you mean ...?`` for an unknown ``key``: the close keys of the config this
    command composes without it (none when that does not compose either)."""
    from fedlightning.config import compose

    args = [a for a in sys.argv[1:] if not a.startswith("-") and a.split("=")[0] != key]
    try:
        cfg = OmegaConf.to_container(compose(args))
    except Exception:
        return []

    def keys(node: object, prefix: str = "") -> list[str]:
        if not isinstance(node, dict):
            return [prefix]
        return [k for name, v in node.items() for k in keys(v, f"{prefix}{name}.")]

    known = [k.rstrip(".") for k in keys(cfg)]
    close = difflib.get_close_matches(key, known, n=3, cutoff=0.75)
    return [f"did you mean {' or '.join(close)}?"] if close else []


def hydra_error_line(e: BaseException, dir_key: str = "hydra.run.dir") -> str | None:
    """One line for what Hydra or OmegaConf raises before (or outside) the run: a group option
    without a config file (with the close names), an override or key Hydra cannot apply, an
    interpolation that fails (naming the key), and a run directory (``dir_key``) Hydra cannot
    create or write. ``None``: not such an error."""
    from hydra.errors import HydraException, MissingConfigException
    from omegaconf.errors import OmegaConfBaseException

    if isinstance(e, MissingConfigException):
        return _missing_option_line(e)
    if isinstance(e, (HydraException, OmegaConfBaseException)):
        return _compact(e)
    if isinstance(e, (OSError, ValueError)) and _in_hydra_job_setup(e):  # mkdir, its log
        cause = f": {e.__cause__}" if e.__cause__ is not None else ""
        return f"config `{dir_key}`: cannot create or write the run directory ({e}{cause})"
    return None


_FULL_ERROR = "HYDRA_FULL_ERROR"  # set: Hydra raises its errors instead of printing them
_user_full_error: list[str | None] = [None]  # the user's own setting, while a task runs
# False, or (when this invocation chose the resume's hydra.run.dir) the resumed checkpoint's
# stamp at the start
_resume_scratch: list[object] = [False]
# a fresh run's hydra.run.dir did not exist before this invocation (a refusal removes it),
# and the folder named on the command line, when there is one
_fresh_dir: list[bool] = [False]
_named_dir: list[Path | None] = [None]


def _show_user_errors_as_set() -> None:
    """While the task runs (and in the processes it starts): the user's HYDRA_FULL_ERROR."""
    if _user_full_error[0] is None:
        os.environ.pop(_FULL_ERROR, None)
    else:
        os.environ[_FULL_ERROR] = _user_full_error[0]


def _in_hydra_job_setup(e: BaseException) -> bool:
    """Whether ``e`` came out of Hydra setting a job up (``run_job``: its directory, log
    file, ``.hydra`` files; a sweeper's ``sweep`` or launcher's ``launch``: the sweep
    directory)."""
    import hydra as hydra_pkg

    root = Path(hydra_pkg.__file__).resolve().parent
    tb = e.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_name in ("run_job", "sweep", "launch") and Path(
            code.co_filename
        ).resolve().is_relative_to(root):
            return True
        tb = tb.tb_next
    return False


def _raised_in_task(e: BaseException) -> bool:
    """Whether ``e`` came out of the task function (``_train``), not Hydra's set-up."""
    code = _train.__wrapped__.__code__
    tb = e.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code is code:
            return True
        tb = tb.tb_next
    return False


def _run_train(multirun: bool) -> None:
    """``_train`` under Hydra, its own errors (composition, the run directory) as one line
    and exit 2 instead of Hydra's report (exit 1); with HYDRA_FULL_ERROR set by the user,
    Hydra's full traceback as Hydra documents it."""
    user = _user_full_error[0] = os.environ.get(_FULL_ERROR)
    os.environ[_FULL_ERROR] = "1"
    try:
        _train()
    except Exception as e:
        line = (
            None
            if user or _raised_in_task(e)
            else hydra_error_line(e, "hydra.sweep.dir" if multirun else "hydra.run.dir")
        )
        if line is None:
            raise
        if _fresh_dir[0] and _named_dir[0] is not None:  # its lock made the folder: remove
            from fedlightning.runs import drop_stub_run_dir

            drop_stub_run_dir(_named_dir[0])
        sys.exit(_error(line))
    finally:
        _show_user_errors_as_set()
        if _named_dir[0] is not None:  # the run is over: its folder's lock goes with it
            from fedlightning.runs import release_run_dirs

            release_run_dirs()


class _FileOnFirstLine(logging.FileHandler):
    """A log file (and its folder) made at its first line: a sweep refused before its study
    opens leaves nothing behind."""

    def _open(self):  # noqa: ANN202 (logging's own signature)
        Path(self.baseFilename).parent.mkdir(parents=True, exist_ok=True)
        return super()._open()


def _sweep_log(path: Path) -> None:
    """Optuna's log lines and the warnings raised while a sweep runs (Optuna's experimental
    features, ...) go to ``path``, not to the terminal."""
    import optuna

    handler = _FileOnFirstLine(path, delay=True)
    handler.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))
    optuna.logging.disable_default_handler()
    logging.captureWarnings(True)
    for name in ("optuna", "py.warnings"):
        logger = logging.getLogger(name)
        logger.addHandler(handler)
        logger.propagate = False


def _sweep(rest: list[str]) -> int:
    if rest[:1] == ["dashboard"]:
        return _sweep_dashboard(rest[1:])
    from fedlightning.sweeps import Sweep, load_spec
    from fedlightning.train import train

    ap = argparse.ArgumentParser(prog="fedlightning sweep", description="Run an Optuna study.")
    ap.add_argument("file", type=Path, help="a sweep file, e.g. sweeps/fedprox_mu_cora.yaml")
    ap.add_argument("--trials", type=int, help="finished trials wanted (default: the file's)")
    ap.add_argument("--storage", help="Optuna storage URL (default: the file's)")
    ap.add_argument("--study", help="study name (default: the file's, or its stem)")
    ap.add_argument("--out", type=Path, default=Path("outputs/sweeps"), help="trial runs")
    args, overrides = ap.parse_known_args(rest)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    spec = load_spec(args.file)
    if args.trials is not None:
        spec.trials = args.trials
    spec.storage = args.storage or spec.storage
    spec.study_name = args.study or spec.study_name

    def quiet_train(cfg, run_dir, observe):
        check_lightning_ddp(cfg, "fedlightning sweep")
        return train(cfg, run_dir, observe, verbose=False)

    sweep = Sweep(spec, args.out, overrides, compose, quiet_train)
    _sweep_log(args.out / spec.study_name / "sweep.log")
    study = sweep.run()
    states = Counter(t.state.name for t in study.trials)
    print("-" * 55)
    print(f"study            {study.study_name} ({spec.storage})")
    print(
        f"output           {args.out / study.study_name} (trials, trials.csv; Optuna's log: sweep.log)"
    )
    if sweep.parent is not None:
        print(f"mlflow run       {sweep.parent.run_id} ({sweep.parent.tracking_uri})")
    print(f"trials           {', '.join(f'{n} {k.lower()}' for k, n in sorted(states.items()))}")
    if states["COMPLETE"]:
        print(f"best {spec.metric:<11} {study.best_value:.4f} (trial {study.best_trial.number})")
        for k, v in study.best_params.items():
            print(f"  {k} = {v}")
    return 0


def _sweep_dashboard(rest: list[str]) -> int:
    """``fedlightning sweep dashboard STUDY``: optuna-dashboard (the ``dashboard`` extra) on
    the storage of a sweep file, or on a storage URL."""
    from fedlightning.sweeps import load_spec

    ap = argparse.ArgumentParser(
        prog="fedlightning sweep dashboard",
        description="Open optuna-dashboard on a sweep's study storage.",
    )
    ap.add_argument("study", help="a sweep file (its storage) or an Optuna storage URL")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8080)
    args = ap.parse_args(rest)
    looks_like_file = args.study.endswith((".yaml", ".yml")) or Path(args.study).is_file()
    storage = load_spec(args.study).storage if looks_like_file else args.study
    try:
        from optuna_dashboard import run_server
    except ImportError:
        raise FedLightningError(
            "fedlightning sweep dashboard needs optuna-dashboard: "
            "pip install 'fedlightning[dashboard]' (or optuna-dashboard)"
        ) from None
    print(f"optuna-dashboard on {storage}: http://{args.host}:{args.port}/", flush=True)
    run_server(storage, host=args.host, port=args.port)
    return 0


def _flower_sim(rest: list[str]) -> int:
    ap = argparse.ArgumentParser(
        prog="fedlightning flower-sim",
        description="Run an experiment as a Flower app in Flower's simulation engine, one "
        "virtual node per client (runner=flower; docs/scaling.md).",
    )
    ap.add_argument("--run-dir", type=Path, help="default outputs/<data>/<name>/<time>")
    args, overrides = ap.parse_known_args(rest)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("fedlightning").setLevel(logging.INFO)  # rounds; others' warnings only
    logging.getLogger("flwr").propagate = False  # Flower prints its own (and its debug lines)
    try:
        from fedlightning.flower.apps import simulate
    except ImportError as e:
        raise FedLightningError(
            f"fedlightning flower-sim needs Flower ({e}): pip install 'fedlightning[flower]'"
        ) from None
    simulate(overrides, args.run_dir)
    return 0


def _manifest(rest: list[str]) -> int:
    from fedlightning.programs.manifest_program import run_manifest

    ap = argparse.ArgumentParser(
        prog="fedlightning data manifest",
        description="Materialize the chronological manifest, ownership, tasks and negatives.",
    )
    ap.add_argument("--out", type=Path, help="default: outputs/<data>/<experiment>/protocol")
    args, overrides = ap.parse_known_args(rest)
    cfg = compose(overrides)
    run_manifest(cfg, args.out or Path("outputs") / run_label(cfg) / str(cfg.name) / "protocol")
    return 0


DATA_USAGE = """usage: fedlightning data SUBCOMMAND ...

subcommands:
  features RAW --out DIR     encode raw node texts and images into a dataset folder
                             (dataset=folder; fedlightning data features --help)
  manifest [--out DIR] [hydra overrides]
                             materialize FedTIP's protocol objects and print the manifest
                             table (fedlightning data manifest --help)
"""


def _data(rest: list[str]) -> int:
    if not rest or rest[0] in ("-h", "--help", "help"):
        print(DATA_USAGE, end="", file=sys.stdout if rest else sys.stderr)
        return 0 if rest else 2
    if rest[0] not in ("features", "manifest"):
        raise FedLightningError(
            f"fedlightning data: unknown subcommand {rest[0]!r} (features or manifest)"
        )
    if rest[0] == "manifest":
        return _manifest(rest[1:])
    from fedlightning.data.features import extract

    ap = argparse.ArgumentParser(
        prog="fedlightning data features",
        description="Encode raw node texts and images into a dataset folder (docs/datasets.md).",
    )
    ap.add_argument("action", choices=["features"])
    ap.add_argument("raw", help="folder with nodes.csv|nodes.jsonl, edges.csv, images/")
    ap.add_argument("--out", required=True, help="the dataset folder to write (new or empty)")
    ap.add_argument("--nodes", help="the node table (default: RAW/nodes.csv or nodes.jsonl)")
    ap.add_argument("--id-column", default="id")
    ap.add_argument("--text-column", default="text")
    ap.add_argument("--label-column", default="label")
    ap.add_argument(
        "--images", help="image folder, files named <node id>.<ext> (default RAW/images)"
    )
    ap.add_argument("--text-model", help="sentence-transformers folder (default: all-MiniLM-L6-v2)")
    ap.add_argument("--image-model", default="efficientnet-lite0", help="or module:factory")
    ap.add_argument("--image-weights", help="state-dict file for a module:factory backbone")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--name", help="dataset name (default: the raw folder's name)")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(rest)
    logging.basicConfig(level=logging.WARNING, format="warning: %(message)s")
    options = {k: v for k, v in vars(args).items() if k not in ("action", "no_progress")}
    record = extract(**options, progress=not args.no_progress)
    print("-" * 55)
    print(f"nodes            {record['nodes']}")
    for m, rec in record["modalities"].items():
        extra = f", {len(rec['unreadable'])} unreadable" if rec.get("unreadable") else ""
        print(
            f"{m:<16} {rec['dim']}-d by {rec.get('model_name', rec.get('encoder'))}, "
            f"{rec['missing']} missing{extra}, {rec['seconds']:.1f} s"
        )
    print(f"written          {args.out} (train: dataset=folder dataset.path={args.out})")
    return 0


def _report(rest: list[str]) -> int:
    from fedlightning.report import main as report_main

    return report_main(rest)


TOOLS = {"sweep": _sweep, "report": _report, "data": _data, "flower-sim": _flower_sim}


def _run_tool(command: str, rest: list[str]) -> int:
    """The commands but ``train``: user errors as one line, exit status 2."""
    try:
        return TOOLS[command](rest)
    except FedLightningError as e:
        return _error(e)
    except Exception as e:  # Hydra's composition errors (an unknown override, group, key)
        from hydra.errors import HydraException
        from omegaconf.errors import OmegaConfBaseException
        from yaml import YAMLError

        if isinstance(e, YAMLError):  # a file the command reads (a sweep file, say)
            return _error(yaml_error_line(e))
        if not isinstance(e, (HydraException, OmegaConfBaseException)):
            raise
        return _error(hydra_error_line(e))


def _error(line: object) -> int:
    """Print a user error as one line; the exit status of one (2)."""
    print(f"error: {line}", file=sys.stderr, flush=True)
    return 2


def _wants_shell_completion(args: list[str]) -> bool:
    """Hydra's ``-sc``/``--shell-completion`` flag (``fedlightning train -sc install=bash``),
    answered by :mod:`fedlightning.completion` rather than by Hydra."""
    from fedlightning.completion import shell_completion_request

    return shell_completion_request(args) is not None


def yaml_error_line(e: Exception) -> str:
    """A YAML syntax error as one line: the file, line and column, and what was expected."""
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None) or str(e).strip().splitlines()[0]
    if mark is None:
        return f"not valid YAML ({problem})"
    return (
        f"{mark.name}: not valid YAML (line {mark.line + 1}, column {mark.column + 1}: {problem})"
    )


def version() -> str:
    """The installed distribution's version (the package's own in a bare checkout)."""
    from fedlightning.tracking.mlflow_tracker import package_version

    return package_version()


def main(argv: list[str] | None = None) -> None:
    """The ``fedlightning`` command; a reader that closes the pipe early (``| head``) ends
    it quietly, as the Python docs advise (``signal-handling`` / ``SIGPIPE``)."""
    try:
        try:
            _main(argv)
        finally:  # also on sys.exit: a closed pipe shows here, not at the interpreter's exit
            sys.stdout.flush()
    except BrokenPipeError:
        # stdout is gone: point it at devnull so that the interpreter's final flush is quiet
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)


def _main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE)
        return
    if args[0] in ("-V", "--version"):
        print(f"fedlightning {version()}")
        return
    command, rest = args[0], args[1:]
    if command == "completion" or _wants_shell_completion(args):
        from fedlightning.completion import main as completion_main

        sys.exit(completion_main(args))
    if command in TOOLS:
        sys.exit(_run_tool(command, rest))
    if command != "train":
        names = ["train", *TOOLS]
        close = difflib.get_close_matches(command, names, n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        print(
            f"error: unknown command {command!r} ({hint}commands: {', '.join(names)}; "
            "fedlightning --help)",
            file=sys.stderr,
        )
        sys.exit(2)
    try:
        _refuse_before_hydra(rest)
    except FedLightningError as e:
        sys.exit(_error(e))
    args = _resume_run_dir(rest)
    # Hydra reads its overrides from sys.argv; Lightning's DDP launcher later re-executes
    # the real program with `train` and the same overrides (see _train).
    _relaunch_argv[:] = [sys.argv[0], "train", *args]
    sys.argv = [f"{Path(sys.argv[0]).name} train", *args]
    _run_train(multirun=any(a in ("-m", "--multirun") for a in args))
