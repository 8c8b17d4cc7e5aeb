"""Config-key-only activation: install FCDP when a process imports DeepSpeed.

``pip install`` puts ``fcdp_deepspeed_autoload.pth`` into site-packages; Python's ``site`` module runs
its one line at every interpreter start (launcher-spawned ranks included), which calls
:func:`startup`. That only puts a finder on ``sys.meta_path``: this module imports nothing but
the standard library, so a process that never imports DeepSpeed pays one small module import and a
string comparison per import. When ``deepspeed`` has finished importing, :func:`startup`'s hook runs
``fcdp_deepspeed.install()``, after which an enabled ``"fcdp"`` block in a DeepSpeed config turns
FCDP on and a config without one runs plain ZeRO-3. DeepSpeed 0.19.8 has no plugin entry point
(no entry-point group, no import hook), hence the startup file.

Opt out with ``FCDP_AUTOLOAD=0``. On an untested DeepSpeed release nothing is installed (one
warning); ``deepspeed.initialize`` then refuses a config with an enabled ``fcdp`` block instead
of silently training without it. The same happens if installing fails.

Why a top-level module: importing anything inside ``fcdp_deepspeed`` runs its ``__init__``,
which imports DeepSpeed and torch.
"""
from __future__ import annotations

import _thread  # not ``threading``/``typing``: this module is imported at every interpreter start
import os
import sys

#: Set to ``0`` (or ``false``/``no``/``off``) to keep the startup hook from installing FCDP.
AUTOLOAD_ENV = "FCDP_AUTOLOAD"
#: DeepSpeed releases the hooks were verified against (parity and traffic tests).
TESTED_DEEPSPEED_VERSIONS = ("0.17.6", "0.18.9", "0.19.8")
#: Set to 1 to run on an untested DeepSpeed release anyway (at your own risk).
ALLOW_UNTESTED_ENV = "FCDP_ALLOW_UNTESTED_DEEPSPEED"

_OFF = ("0", "false", "no", "off")


class UnsupportedDeepSpeedVersion(ImportError):
    """The installed DeepSpeed release was never tested with FCDP."""


def autoload_enabled(env: Optional[dict] = None) -> bool:
    return (env if env is not None else os.environ).get(AUTOLOAD_ENV, "1").strip().lower() not in _OFF


def version_is_tested(version: str, env: Optional[dict] = None) -> bool:
    allow = (env if env is not None else os.environ).get(ALLOW_UNTESTED_ENV, "") == "1"
    return version.split("+")[0] in TESTED_DEEPSPEED_VERSIONS or allow


def untested_message(version: str) -> str:
    return (f"fcdp-deepspeed was tested with deepspeed=={', '.join(TESTED_DEEPSPEED_VERSIONS)} but "
            f"deepspeed=={version} is installed. Fix: `pip install deepspeed=={TESTED_DEEPSPEED_VERSIONS[-1]}`, "
            f"or set {ALLOW_UNTESTED_ENV}=1 to run untested (verify parity with `\"verify\": true`).")


# -- post-import hooks ------------------------------------------------------------------------------
_HOOKS: dict[str, list[Callable[[Any], None]]] = {}
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


class _PostImportFinder:
    """First on ``sys.meta_path``: finds watched modules with the other finders and chains the hooks
    onto their loader. Everything else costs one dict lookup."""

    def __init__(self) -> None:
        self._busy = _thread._local()

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name not in _HOOKS or getattr(self._busy, "active", False):
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


def when_imported(name: str, hook: Callable[[Any], None]) -> None:
    """Run ``hook(module)`` once ``name`` has finished importing, or now if it is in ``sys.modules``."""
    with _LOCK:
        module = sys.modules.get(name)
        if module is None:
            hooks = _HOOKS.setdefault(name, [])
            if hook not in hooks:
                hooks.append(hook)
            if _FINDER not in sys.meta_path:
                sys.meta_path.insert(0, _FINDER)
            return
    hook(module)


def forget(name: str, hook: Callable[[Any], None]) -> None:
    """Drop a hook registered with :func:`when_imported` that has not run yet."""
    with _LOCK:
        hooks = _HOOKS.get(name, [])
        if hook in hooks:
            hooks.remove(hook)
        if not hooks:
            _HOOKS.pop(name, None)
        if not _HOOKS and _FINDER in sys.meta_path:
            sys.meta_path.remove(_FINDER)


def _run_hooks(name: str, module: Any) -> None:
    with _LOCK:
        hooks = _HOOKS.pop(name, [])
        if not _HOOKS and _FINDER in sys.meta_path:
            sys.meta_path.remove(_FINDER)
    for hook in hooks:
        hook(module)


# -- the DeepSpeed hook -----------------------------------------------------------------------------
def _warn(message: str) -> None:
    import warnings
    warnings.warn(message, RuntimeWarning, stacklevel=2)


_INSTALL_PENDING = False


def _initializing(module: Any) -> bool:
    return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


def on_deepspeed_imported(deepspeed: Any) -> None:
    """Install FCDP into a freshly imported DeepSpeed; never break the import."""
    global _INSTALL_PENDING
    version = str(getattr(deepspeed, "__version__", "unknown"))
    if not version_is_tested(version):
        reason = untested_message(version)
        _warn(f"fcdp-deepspeed autoload: not installed. {reason} (Set {AUTOLOAD_ENV}=0 to silence this.)")
        refuse_enabled_block(deepspeed, reason)
        return
    package = sys.modules.get("fcdp_deepspeed")
    if package is not None and _initializing(package):
        # `import fcdp_deepspeed` imported DeepSpeed: install once the package is complete (package_ready)
        _INSTALL_PENDING = True
        return
    _install(deepspeed)


def package_ready() -> None:
    """Called at the end of ``fcdp_deepspeed/__init__``: finish an install deferred by the hook."""
    global _INSTALL_PENDING
    if _INSTALL_PENDING:
        _INSTALL_PENDING = False
        _install(sys.modules["deepspeed"])


def _install(deepspeed: Any) -> None:
    try:
        import fcdp_deepspeed
        fcdp_deepspeed.install()
    except Exception as exc:  # the user's job must not fail because the plugin did
        reason = f"installing FCDP failed: {type(exc).__name__}: {exc}."
        _warn(f"fcdp-deepspeed autoload: {reason} DeepSpeed runs without FCDP.")
        refuse_enabled_block(deepspeed, reason)


def refuse_enabled_block(deepspeed: Any, reason: str) -> None:
    """Wrap ``deepspeed.initialize`` so a config with an enabled ``fcdp`` block fails with ``reason``
    instead of training as plain DeepSpeed. Public API only: it must work on releases we never saw."""
    import functools
    import inspect

    original = getattr(deepspeed, "initialize", None)
    if original is None or getattr(original, "_fcdp_refusing", False):
        return
    try:
        signature: Optional[inspect.Signature] = inspect.signature(original)
    except (TypeError, ValueError):
        signature = None

    @functools.wraps(original)
    def initialize(*args: Any, **kwargs: Any) -> Any:
        if _block_enabled(_config_argument(signature, args, kwargs)):
            raise UnsupportedDeepSpeedVersion(
                f"this DeepSpeed config enables \"fcdp\" but FCDP is not active: {reason} "
                f"Fix that, or set \"fcdp\": {{\"enabled\": false}} to train without FCDP.")
        return original(*args, **kwargs)

    initialize._fcdp_refusing = True  # type: ignore[attr-defined]
    deepspeed.initialize = initialize


def _config_argument(signature: Any, args: tuple, kwargs: dict) -> Any:
    bound: dict = dict(kwargs)
    if signature is not None:
        try:
            arguments = signature.bind_partial(*args, **kwargs).arguments
        except TypeError:
            arguments = {}
        for name, value in arguments.items():
            kind = signature.parameters[name].kind
            if kind is kind.VAR_KEYWORD:
                bound.update(value)
            elif kind is not kind.VAR_POSITIONAL:
                bound[name] = value
    config = bound.get("config") or bound.get("config_params")
    if config is None:
        config = getattr(bound.get("args"), "deepspeed_config", None)
    return config


def _block_enabled(config: Any) -> bool:
    """Best effort: a dict, a JSON/HJSON path, or an object holding a dict (``_param_dict``/``config``)."""
    if isinstance(config, (str, os.PathLike)):
        try:
            with open(config) as f:
                text = f.read()
            try:
                import json
                config = json.loads(text)
            except ValueError:
                import hjson  # what DeepSpeed itself reads configs with
                config = hjson.loads(text)
        except Exception:
            return False
    for attr in ("_param_dict", "config"):
        if not isinstance(config, dict) and isinstance(getattr(config, attr, None), dict):
            config = getattr(config, attr)
    block = config.get("fcdp") if isinstance(config, dict) else None
    return block is True or (isinstance(block, dict) and bool(block.get("enabled", False)))


def startup() -> None:
    """Called by the ``.pth`` line at interpreter start: watch for DeepSpeed unless opted out."""
    if autoload_enabled():
        when_imported("deepspeed", on_deepspeed_imported)
