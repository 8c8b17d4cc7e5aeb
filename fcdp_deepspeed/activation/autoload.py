"""Config-key-only activation: install FCDP when a process imports DeepSpeed.

The startup hook (``fcdp_deepspeed_autoload``, run by a ``.pth`` line at every interpreter start)
calls :func:`start`, which only registers post-import hooks (:mod:`fcdp_deepspeed.activation.post_import`).
When ``deepspeed`` has finished importing, :func:`on_deepspeed_imported` runs the core's
``install()`` (``activation/api.py``; the startup hook installs the integrations itself); an enabled ``"fcdp"`` block then turns FCDP on and a config without
one runs plain ZeRO-3. Standard library only at import: nothing here may pull in torch or DeepSpeed.

On an untested DeepSpeed release nothing is installed (one warning); ``deepspeed.initialize`` then
refuses a config with an enabled ``fcdp`` block instead of silently training without it. The same
happens if installing fails.
"""
from __future__ import annotations

import os
import sys
# [Note: no runtime ``typing`` import: the startup hook imports this module at every interpreter start.]
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Mapping, Optional


from fcdp_deepspeed.activation import post_import
from fcdp_deepspeed.activation.version_gate import UnsupportedDeepSpeedVersion, untested_message, version_is_tested

#: Set to ``0`` (or ``false``/``no``/``off``) to keep the startup hook from installing FCDP.
AUTOLOAD_ENV = "FCDP_AUTOLOAD"
PACKAGE = "fcdp_deepspeed"
_OFF = ("0", "false", "no", "off")
_INSTALL_PENDING = False


def autoload_enabled(env: Optional[Mapping[str, str]] = None) -> bool:
    return (env if env is not None else os.environ).get(AUTOLOAD_ENV, "1").strip().lower() not in _OFF


def start() -> None:
    """Watch for DeepSpeed (and for this package's own modules, see :func:`on_deepspeed_imported`)."""
    post_import.after_each_import(PACKAGE + ".", _after_package_module)
    post_import.when_imported("deepspeed", on_deepspeed_imported)


def _warn(message: str) -> None:
    import warnings
    warnings.warn(message, RuntimeWarning, stacklevel=2)


def _initializing(module: Any) -> bool:
    return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


def _package_initializing(besides: Any = None) -> bool:
    """Whether a module of this package is still running its body (``besides``, the one finishing, aside)."""
    return any(_initializing(m) for name, m in list(sys.modules.items())
               if m is not besides and (name == PACKAGE or name.startswith(PACKAGE + ".")))


def on_deepspeed_imported(deepspeed: Any) -> None:
    """Install FCDP into a freshly imported DeepSpeed; never break the import."""
    global _INSTALL_PENDING
    version = str(getattr(deepspeed, "__version__", "unknown"))
    if not version_is_tested(version):
        reason = untested_message(version)
        _warn(f"fcdp-deepspeed autoload: not installed. {reason} (Set {AUTOLOAD_ENV}=0 to silence this.)")
        refuse_enabled_block(deepspeed, reason)
        _stop_watching_package()
        return
    if _package_initializing():
        # [Note: a module of this package imported DeepSpeed; installing now would import half-run
        # modules. The install runs when the last of them has finished (_after_package_module).]
        _INSTALL_PENDING = True
        return
    _install(deepspeed)


def _after_package_module(module: Any) -> None:
    global _INSTALL_PENDING
    if _INSTALL_PENDING and not _package_initializing(besides=module):
        _INSTALL_PENDING = False
        _install(sys.modules["deepspeed"])


def _stop_watching_package() -> None:
    post_import.forget(PACKAGE + ".", _after_package_module)


def _install(deepspeed: Any) -> None:
    _stop_watching_package()
    try:
        # [Note: the core only] The startup hook installs the integrations itself (fcdp_deepspeed_autoload.startup);
        # calling the package's install() from here would be an import back up to the facade.
        from fcdp_deepspeed.activation import api
        api.install()
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
