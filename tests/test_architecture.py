"""The plugin core never imports the tooling.

A training process loads only the core (``fcdp_deepspeed/*.py``, ``fcdp_deepspeed/runtime/``);
the tooling in ``fcdp_deepspeed/tools/`` (launcher, emulated cluster, toy models, benchmark,
planner, demo, CLI) runs beside it. The old paths of the moved tool modules stay as aliases; they
belong to the tooling side, so the core may not import them either. Two checks: every import in
the core's source, and importing every core module where ``fcdp_deepspeed.tools`` cannot be
imported at all (which also catches imports the source check cannot see).
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent.parent / "fcdp_deepspeed"
TOOLS = "fcdp_deepspeed.tools"
#: Old paths of the tool modules, kept so old imports and ``python -m`` keep working.
ALIASES = {f"fcdp_deepspeed.{name}": f"{TOOLS}.{name}"
           for name in ("bench", "cli", "cluster", "demo", "launch", "planner", "toy", "_worker")}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def core_modules() -> dict[str, Path]:
    """Every module of the package outside ``tools/``, aliases excluded."""
    modules = {_module_name(p): p for p in sorted(PACKAGE_DIR.rglob("*.py"))}
    return {name: path for name, path in modules.items()
            if name != TOOLS and not name.startswith(TOOLS + ".") and name not in ALIASES}


def _called_name(call: ast.Call) -> str | None:
    return getattr(call.func, "attr", getattr(call.func, "id", None))


def imported_names(path: Path, module: str) -> set[str]:
    """Modules a file may import: ``import a.b``, ``from a import b`` (``a`` and ``a.b``: ``b`` may be a
    submodule), relative imports resolved, and ``import_module("...")`` with a literal name."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Call) and _called_name(node) == "import_module" and node.args:
            if isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                names.add(node.args[0].value)
    return names


def _is_tooling(name: str) -> bool:
    return name == TOOLS or name.startswith(TOOLS + ".") or name in ALIASES


def test_the_check_sees_the_whole_core():
    core = core_modules()
    for expected in ("fcdp_deepspeed", "fcdp_deepspeed.api", "fcdp_deepspeed.stage3", "fcdp_deepspeed.runtime",
                     "fcdp_deepspeed.runtime.fetch"):
        assert expected in core, sorted(core)
    assert not any(_is_tooling(name) for name in core)


def test_core_source_never_imports_the_tooling():
    offenders = {name: sorted(n for n in imported_names(path, name) if _is_tooling(n))
                 for name, path in core_modules().items()}
    assert not {k: v for k, v in offenders.items() if v}, "the core imports the tooling (move the code or invert it)"


def test_old_paths_are_aliases_and_nothing_else():
    """Each old path is one ``alias(__name__, "<new path>")`` call, so it cannot grow code of its own."""
    for old, new in ALIASES.items():
        path = PACKAGE_DIR / f"{old.rpartition('.')[2]}.py"
        body = ast.parse(path.read_text()).body
        assert isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)  # docstring
        assert ast.unparse(body[1]) == "from fcdp_deepspeed.tools._alias import alias", path
        assert ast.unparse(body[2]) == f"alias(__name__, {new!r})" and len(body) == 3, path
        assert (PACKAGE_DIR / "tools" / path.name).exists(), new


def test_old_paths_resolve_to_the_moved_modules():
    import importlib
    for old, new in ALIASES.items():
        assert importlib.import_module(old) is importlib.import_module(new), old
    from fcdp_deepspeed import toy
    from fcdp_deepspeed.tools import toy as moved
    assert toy is moved


BLOCKED_IMPORT = """
import importlib, importlib.abc, sys
TOOLS = {tools!r}

class NoTooling(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == TOOLS or name.startswith(TOOLS + "."):
            raise ImportError(f"the core imported {{name}}")
        return None

sys.meta_path.insert(0, NoTooling())
for name in {modules!r}:
    importlib.import_module(name)
loaded = sorted(m for m in sys.modules if m == TOOLS or m.startswith(TOOLS + "."))
assert not loaded, loaded
print("core imported without the tooling:", len({modules!r}), "modules")
"""


def test_every_core_module_imports_with_the_tooling_unimportable():
    modules = sorted(core_modules())
    env = dict(os.environ, DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cpu"))
    proc = subprocess.run([sys.executable, "-c", BLOCKED_IMPORT.format(tools=TOOLS, modules=modules)], env=env,
                          capture_output=True, text=True, timeout=300, cwd=str(PACKAGE_DIR.parent))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "core imported without the tooling" in proc.stdout


AUTOLOAD = PACKAGE_DIR.parent / "fcdp_deepspeed_autoload.py"


def test_startup_hook_imports_only_the_standard_library():
    """``fcdp_deepspeed_autoload`` runs at every interpreter start (its .pth line): it may import nothing
    but the standard library, at module level or inside its functions, except the package itself when
    DeepSpeed was imported (and hjson, DeepSpeed's own config reader, for a non-JSON config path)."""
    allowed_lazily = {"fcdp_deepspeed", "hjson"}
    names = imported_names(AUTOLOAD, "fcdp_deepspeed_autoload")
    top = {n.split(".")[0] for n in names if n}
    assert not {n for n in top if n not in sys.stdlib_module_names and n not in allowed_lazily}, top
    module_level = set()
    for node in ast.parse(AUTOLOAD.read_text()).body:
        if isinstance(node, ast.Import):
            module_level.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            module_level.add((node.module or "").split(".")[0])
    assert module_level <= {"__future__", "_thread", "os", "sys"}, module_level


def test_integrations_import_their_framework_only_when_used():
    code = ("import sys, fcdp_deepspeed.integrations.hf as hf; assert 'transformers' not in sys.modules, 'at import'; "
            "hf.FCDPStatsCallback; assert 'transformers' in sys.modules; print('ok')")
    env = dict(os.environ, DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cpu"))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                          cwd=str(PACKAGE_DIR.parent))
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]
