"""Where the Hydra configs are: :func:`conf_dir`, the one function every reader of the
configs goes through. The repository's ``conf/`` is their one source: a wheel ships it as
the package's ``conf`` folder (``setup.py``), a source checkout reads ``conf/`` next to the
package; both are found from the imported package's location, so the configs always belong
to the ``fedlightning`` that runs them."""

from __future__ import annotations

from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
ROOT_CONFIG = "train.yaml"


def conf_dir() -> Path:
    """The config directory of the imported ``fedlightning``: ``conf`` inside the package
    (an installed wheel), else ``conf/`` of the source checkout the package lives in."""
    for candidate in (PACKAGE_DIR / "conf", PACKAGE_DIR.parent / "conf"):
        if (candidate / ROOT_CONFIG).is_file():
            return candidate
    raise FileNotFoundError(
        f"fedlightning's configs ({ROOT_CONFIG}) are neither in {PACKAGE_DIR / 'conf'} (a "
        f"wheel install) nor in {PACKAGE_DIR.parent / 'conf'} (a source checkout): reinstall "
        "the package"
    )
