"""Lean start-up: PyG and torchmetrics imported without the heavy optional packages they
probe whenever installed (why and what it saves: docs/scaling.md, "Start-up time").

:func:`install` (called by ``fedlightning/__init__.py``) puts one finder first on
``sys.meta_path``: while a guarded package's ``__init__`` runs, and only in the importing
thread, its probed packages (:data:`GUARDED`) look absent (``ModuleNotFoundError``, no
distribution metadata), so it takes its own "not installed" branch. Once every guarded
package is imported the finder removes itself and the probed packages import normally. A
guarded package already imported is not guarded, a probed one already imported never hidden."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from importlib.machinery import ModuleSpec

# guarded package -> the optional packages hidden while its ``__init__`` runs
GUARDED: dict[str, tuple[str, ...]] = {
    "torch_geometric": ("transformers",),
    "torchmetrics": ("transformers", "matplotlib", "scipy"),
}

ENV_SWITCH = "FEDLIGHTNING_LEAN_IMPORTS"


class _GuardedLoader:
    """Runs the real loader of a guarded package with its probed packages hidden (a loader
    by duck typing, as the import system needs: ``importlib.abc`` costs a few ms)."""

    def __init__(self, finder: LeanImportFinder, spec: Any, hidden: frozenset[str]) -> None:
        self._finder = finder
        self._loader = spec.loader
        self._spec = spec
        self._hidden = hidden

    def create_module(self, spec: Any) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        # nothing keeps seeing this wrapper: the module's loader is the real one
        self._spec.loader = self._loader
        module.__loader__ = self._loader
        with self._finder.hiding(self._hidden):
            self._loader.exec_module(module)
        self._finder.done(self._spec.name)


class LeanImportFinder:
    """Hides the probed packages of :data:`GUARDED` while a guarded package is first imported."""

    def __init__(self, guarded: dict[str, tuple[str, ...]]) -> None:
        self.pending = dict(guarded)
        self._state = threading.local()

    def hidden_now(self) -> frozenset[str]:
        return getattr(self._state, "hidden", frozenset())

    @contextmanager
    def hiding(self, names: frozenset[str]) -> Iterator[None]:
        before = self.hidden_now()
        self._state.hidden = before | names
        try:
            yield
        finally:
            self._state.hidden = before
            # lightning_utilities caches "is this package importable?": forget the answers
            # given while packages were hidden
            utilities = sys.modules.get("lightning_utilities.core.imports")
            for name in ("package_available", "module_available"):
                cached = getattr(utilities, name, None)
                if hasattr(cached, "cache_clear"):
                    cached.cache_clear()

    def done(self, package: str) -> None:
        self.pending.pop(package, None)
        if not self.pending:
            uninstall()

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname.partition(".")[0] in self.hidden_now():
            raise ModuleNotFoundError(
                f"{fullname} is hidden while a guarded package imports "
                f"(fedlightning.utils.lean_imports; {ENV_SWITCH}=0 switches this off)",
                name=fullname,
            )
        if fullname not in self.pending or fullname in sys.modules:
            return None
        spec = None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        hidden = frozenset(n for n in self.pending[fullname] if n not in sys.modules)
        spec.loader = _GuardedLoader(self, spec, hidden)
        return spec

    def find_distributions(self, context: Any = None) -> Iterator[Any]:
        name = getattr(context, "name", None)
        if name and name.replace("-", "_").lower() in self.hidden_now():
            from importlib.metadata import PackageNotFoundError

            raise PackageNotFoundError(name)
        return iter(())


_finder: LeanImportFinder | None = None


def install() -> None:
    """Guard the first import of the packages of :data:`GUARDED` not imported yet."""
    global _finder
    if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "no", "off"):
        return
    if _finder is not None and _finder in sys.meta_path:
        return
    pending = {name: hidden for name, hidden in GUARDED.items() if name not in sys.modules}
    if not pending:
        return
    _finder = LeanImportFinder(pending)
    sys.meta_path.insert(0, _finder)


def uninstall() -> None:
    """Remove the finder (it removes itself once every guarded package is imported)."""
    global _finder
    if _finder is not None and _finder in sys.meta_path:
        sys.meta_path.remove(_finder)
    _finder = None
