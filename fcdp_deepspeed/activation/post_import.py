"""Post-import hooks: run a function right after a module has finished importing.

A finder first on ``sys.meta_path`` finds watched modules with the other finders and chains the
hooks onto their loader; every other import costs a dict lookup and a prefix check. Standard library
only (``_thread``, not ``threading``): the startup hook imports this at every interpreter start.
"""
from __future__ import annotations

import _thread
import sys
# [Note: no runtime ``typing`` import: the startup hook imports this module at every interpreter start.]
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Callable

    Hook = Callable[[Any], None]


_HOOKS: dict[str, list[Hook]] = {}  # module name -> hooks run once, when it has been imported
_PREFIX_HOOKS: dict[str, list[Hook]] = {}  # name prefix -> hooks run after each module under it
_LOCK = _thread.RLock()


class _ChainedLoader:
    """The module's own loader, plus the hooks once the module body has run."""

    def __init__(self, loader: Any, name: str) -> None:
        self.loader = loader
        self.name = name

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        # the module keeps its real loader (importlib.resources, pkgutil, reload use it)
        module.__loader__ = self.loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        _run_hooks(self.name, module)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.loader, attr)


def _watched(name: str) -> bool:
    return name in _HOOKS or any(name.startswith(prefix) for prefix in _PREFIX_HOOKS)


class _PostImportFinder:
    """Finds watched modules with the other finders and chains the hooks onto their loader."""

    def __init__(self) -> None:
        self._busy = _thread._local()

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if not _watched(name) or getattr(self._busy, "active", False):
            return None
        self._busy.active = True
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    break
            else:
                return None
        finally:
            self._busy.active = False
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _ChainedLoader(spec.loader, name)
        return spec


_FINDER = _PostImportFinder()


def _sync_finder() -> None:
    """The finder sits on ``sys.meta_path`` exactly while something is watched (caller holds the lock)."""
    if (_HOOKS or _PREFIX_HOOKS) and _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
    elif not _HOOKS and not _PREFIX_HOOKS and _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)


def when_imported(name: str, hook: Hook) -> None:
    """Run ``hook(module)`` once ``name`` has finished importing, or now if it is in ``sys.modules``."""
    with _LOCK:
        module = sys.modules.get(name)
        if module is None:
            hooks = _HOOKS.setdefault(name, [])
            if hook not in hooks:
                hooks.append(hook)
            _sync_finder()
            return
    hook(module)


def after_each_import(prefix: str, hook: Hook) -> None:
    """Run ``hook(module)`` after every module whose name starts with ``prefix`` is imported, until
    :func:`forget` drops it (modules already imported are not revisited)."""
    with _LOCK:
        hooks = _PREFIX_HOOKS.setdefault(prefix, [])
        if hook not in hooks:
            hooks.append(hook)
        _sync_finder()


def forget(name: str, hook: Hook) -> None:
    """Drop a hook of :func:`when_imported` that has not run yet, or one of :func:`after_each_import`."""
    with _LOCK:
        for table in (_HOOKS, _PREFIX_HOOKS):
            hooks = table.get(name, [])
            if hook in hooks:
                hooks.remove(hook)
            if not hooks:
                table.pop(name, None)
        _sync_finder()


def _run_hooks(name: str, module: Any) -> None:
    with _LOCK:
        hooks = _HOOKS.pop(name, [])
        hooks += [h for prefix, hs in _PREFIX_HOOKS.items() if name.startswith(prefix) for h in hs]
        _sync_finder()
    for hook in hooks:
        hook(module)
