"""The package's rooms and floors, checked on its source (AST) and by importing it (docs/architecture.md).

- every module lies in one room (a folder of the package, or one of its four root files), and the rooms
  stand on floors (``FLOORS``, bottom first): a module imports, at module level or inside a function,
  modules of its own room and of rooms on lower floors only; two rooms on one floor never import each other;
- the package root holds the facade, ``version.py``, ``run.py``, ``faults.py``, ``paths.py`` (the path rule, standard
  library only, shared by the engine and ``fcdp plan``) and the rooms' folders, each
  with an ``__init__`` docstring that says what it holds; ``tools/`` holds the ``fcdp`` command's dispatch, its
  one-module commands and one folder per larger command;
- the core (everything but ``tools/``, ``integrations/`` and the facade) never imports the tooling, the
  integrations or the startup hook (``fcdp_deepspeed_autoload``), and imports without them;
- the package facade (``fcdp_deepspeed/__init__.py``) is lazy and may reach the integrations (its
  ``install()`` installs them), never the tooling;
- nothing in the package imports the startup hook, which imports nothing but the standard library and
  the package's standard-library-only modules (``activation/``'s startup path);
- no import circle among the package's modules (module-level imports);
- no class of the core is longer than 600 lines: one concept per class, as large as the concept is; the bound only
  catches a class that has become several (a smaller cap split concepts along line counts, issue 48).
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_DIR = ROOT / "fcdp_deepspeed"
PACKAGE = "fcdp_deepspeed"
FACADE = PACKAGE
TOOLS = "fcdp_deepspeed.tools"
INTEGRATIONS = "fcdp_deepspeed.integrations"
STARTUP = "fcdp_deepspeed_autoload"
STARTUP_FILE = ROOT / f"{STARTUP}.py"
#: What the startup hook imports (at every interpreter start): the facade, the startup path of ``activation/``
#: (standard library only) and the integrations' post-import registry.
STARTUP_MODULES = {PACKAGE, "fcdp_deepspeed.activation", "fcdp_deepspeed.activation.autoload",
                   "fcdp_deepspeed.activation.post_import", "fcdp_deepspeed.activation.version_gate", INTEGRATIONS}

#: The rooms, bottom floor first ("" is the facade, ``fcdp_deepspeed/__init__.py``; a root file is a room of its
#: own). A module may import modules of its own room and of rooms on lower floors; rooms on one floor are apart.
FLOORS: list[tuple[str, ...]] = [
    ("faults", "version", "paths"),  # test faults; the package version; which paths a job's links call for
    ("config",),              # the config blocks, their refusals, DeepSpeed's release differences
    ("machine",),             # the device door and strict mode; nodes, groups, communicators
    ("compress",),            # the codec of the inter-node hop (a leaf: each path applies it), its state envelope
    ("reporting",),           # byte ledger, counters, timeline, monitor
    ("storage",),             # cache entries and slots, placement, memory limits
    ("grads",),               # the gradient path, its compressed inter-node stage and residuals included
    ("runtime", "diloco", "layered"),  # the parameter cache per engine, its compressed stage 1; DiLoCo's outer steps;
                                       # layered accumulation's chunk loop over a model's layers
    ("engine",),              # the stage-3 optimizer subclasses and what an engine adds
    ("activation",),          # install(), the startup path, the version gate
    ("integrations",),        # the HF Trainer callback
    ("",),                    # the facade: the public names, lazy
    ("run",),                 # python -m fcdp_deepspeed.run: install(), then the user's script
    ("tools",),               # beside a job, never inside one
]
#: One-module ``fcdp`` commands and the dispatch that stay in ``tools/`` itself; every larger command is a folder.
TOOLS_ROOT = {"__init__", "cli", "args", "configs", "doctor"}
#: The lab: the repository's bench, harness, fuzz machine, ... (``fcdp_lab/``), never imported by the package.
LAB = "fcdp_lab"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def package_modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE_DIR.rglob("*.py"))}


def core_modules() -> dict[str, Path]:
    """Every module of the package outside ``tools/`` and ``integrations/``, the facade excluded."""
    return {name: path for name, path in package_modules().items()
            if name != FACADE and not _under(name, TOOLS) and not _under(name, INTEGRATIONS)}


def _called_name(call: ast.Call) -> str | None:
    return getattr(call.func, "attr", getattr(call.func, "id", None))


def _import_names(node: ast.AST, package: str) -> set[str]:
    names: set[str] = set()
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


def _package_of(path: Path, module: str) -> str:
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def imported_names(path: Path, module: str) -> set[str]:
    """Modules a file may import anywhere in it: ``import a.b``, ``from a import b`` (``a`` and ``a.b``:
    ``b`` may be a submodule), relative imports resolved, and ``import_module("...")`` with a literal."""
    package = _package_of(path, module)
    return {n for node in ast.walk(ast.parse(path.read_text(), str(path))) for n in _import_names(node, package)}


def module_level_imports(path: Path, module: str) -> set[str]:
    """Imports run when the module is imported: its body, outside function and class bodies."""
    package = _package_of(path, module)
    names: set[str] = set()
    stack = list(ast.parse(path.read_text(), str(path)).body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        names |= _import_names(node, package)
        stack.extend(ast.iter_child_nodes(node))
    return names


def import_graph() -> dict[str, set[str]]:
    """Module -> package modules it imports at module level (a parent package's ``__init__`` is not an
    edge of its own: importing ``a.b`` runs ``a``'s, which is checked as a module of its own)."""
    modules = package_modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for imported in module_level_imports(path, name):
            while imported and imported not in modules:
                imported = imported.rpartition(".")[0]
            if imported and imported != name and not _under(name, imported):
                targets.add(imported)
        graph[name] = targets
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` (as a path that ends where it starts), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def room_of(module: str) -> str:
    """``fcdp_deepspeed.machine.device`` -> ``machine``; the facade -> ``""``."""
    return module.split(".")[1] if module.count(".") else ""


def import_targets(path: Path, module: str, modules: set[str]) -> set[str]:
    """Package modules a file imports anywhere in it. ``from fcdp_deepspeed import x`` reaches the module
    ``x`` where there is one and the facade otherwise; ``import fcdp_deepspeed.a.b`` reaches ``a.b``."""
    package = _package_of(path, module)
    targets: set[str] = set()

    def nearest(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        found: list[str | None] = []
        if isinstance(node, ast.Import):
            found = [nearest(alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else nearest(base)
                     for alias in node.names]
        elif isinstance(node, ast.Call) and _called_name(node) == "import_module" and node.args:
            if isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                found = [nearest(node.args[0].value)]
        targets.update(f for f in found if f and _under(f, PACKAGE) and f != module)
    return targets


def all_imports() -> dict[str, set[str]]:
    modules = package_modules()
    return {name: import_targets(path, name, set(modules)) for name, path in modules.items()}


def floor_violations(edges: dict[str, set[str]]) -> list[str]:
    """Imports that run up a floor or across one (between two rooms of one floor)."""
    floor = {room: i for i, rooms in enumerate(FLOORS) for room in rooms}
    return sorted(f"{src} -> {dst}" for src, targets in edges.items() for dst in targets
                  if room_of(src) != room_of(dst) and floor[room_of(dst)] >= floor[room_of(src)])


def test_every_module_lies_in_a_room_on_a_floor():
    rooms = {room for floor in FLOORS for room in floor}
    assert {room_of(name) for name in package_modules()} == rooms


def test_no_import_runs_up_or_across_a_floor():
    assert floor_violations(all_imports()) == []


def test_the_floor_check_finds_imports_up_and_across():
    """Broken variants: the config block importing the codec it configures (the arrow this layout removed),
    runtime and DiLoCo importing each other (one floor), and the startup path calling the facade back."""
    assert floor_violations({"fcdp_deepspeed.config": {"fcdp_deepspeed.compress.quant"}}) == [
        "fcdp_deepspeed.config -> fcdp_deepspeed.compress.quant"]
    assert floor_violations({"fcdp_deepspeed.runtime.fetch": {"fcdp_deepspeed.diloco.sync"}}) != []
    assert floor_violations({"fcdp_deepspeed.activation.autoload": {PACKAGE}}) != []
    assert floor_violations({"fcdp_deepspeed.compress.quant": {"fcdp_deepspeed.config"},
                             "fcdp_deepspeed.engine.stage3": {"fcdp_deepspeed.engine.announce"}}) == []
    # the codec is a leaf: it never reaches back into a path that applies it
    assert floor_violations({"fcdp_deepspeed.compress.quant": {"fcdp_deepspeed.grads.inflight"}}) != []
    assert floor_violations({"fcdp_deepspeed.grads.compressed": {"fcdp_deepspeed.compress.quant"}}) == []


def test_the_import_reader_resolves_the_facade_and_submodules(tmp_path):
    source = tmp_path / "x.py"
    source.write_text("import fcdp_deepspeed\nfrom fcdp_deepspeed import install, faults\n"
                      "def f():\n    from fcdp_deepspeed.machine import device\n    from .. import config\n")
    modules = {PACKAGE, "fcdp_deepspeed.faults", "fcdp_deepspeed.machine", "fcdp_deepspeed.machine.device",
               "fcdp_deepspeed.config", "fcdp_deepspeed.engine.x"}
    assert import_targets(source, "fcdp_deepspeed.engine.x", modules) == {
        PACKAGE, "fcdp_deepspeed.faults", "fcdp_deepspeed.machine.device", "fcdp_deepspeed.config"}


def test_the_root_shows_the_rooms_and_each_says_what_it_holds():
    rooms = {room for floor in FLOORS for room in floor} - {""}
    files = {p.stem for p in PACKAGE_DIR.glob("*.py")}
    folders = {p.name for p in PACKAGE_DIR.iterdir() if (p / "__init__.py").exists()}
    assert files == {"__init__", "faults", "version", "run", "paths"}, files
    assert folders == rooms - files, folders
    for init in PACKAGE_DIR.rglob("__init__.py"):
        assert ast.get_docstring(ast.parse(init.read_text())), f"{init.relative_to(ROOT)} says nothing of what it holds"


def test_tools_are_grouped_by_command():
    tools = PACKAGE_DIR / "tools"
    assert {p.stem for p in tools.glob("*.py")} == TOOLS_ROOT
    cli = ast.parse((tools / "cli.py").read_text())
    commands = next(ast.literal_eval(n.value) for n in cli.body
                    if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "COMMANDS")
    for name, (module, _) in commands.items():  # a one-module command, or a module of the command's folder
        assert module in package_modules() and module.count(".") in (2, 3), (name, module)


def test_no_history_in_the_package():
    """Docstrings and comments say why, never when: no issue number and no date in any module of the package."""
    import re
    pattern = re.compile(r"\b[Ii]ssues? #?\d+|\b20\d\d-\d\d-\d\d\b")
    found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}" for path in sorted(PACKAGE_DIR.rglob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert not found, found


def test_the_package_never_imports_the_lab():
    """The wheel holds the plugin: no module of the package imports ``fcdp_lab`` (the lab is not installed)."""
    found = sorted(f"{name} imports {imported}" for name, path in package_modules().items()
                   for imported in imported_names(path, name) if _under(imported, LAB))
    assert not found, found


def test_the_checks_see_the_whole_package():
    core = core_modules()
    for expected in ("fcdp_deepspeed.activation.api", "fcdp_deepspeed.engine.stage3", "fcdp_deepspeed.runtime",
                     "fcdp_deepspeed.runtime.fetch", "fcdp_deepspeed.activation.autoload", "fcdp_deepspeed.activation.version_gate"):
        assert expected in core, sorted(core)
    graph = import_graph()
    assert {"fcdp_deepspeed.engine.stage3", "fcdp_deepspeed.reporting.engine_stats"} <= graph["fcdp_deepspeed.activation.api"]
    assert "fcdp_deepspeed.runtime.fetch" in graph["fcdp_deepspeed.runtime"]
    assert "fcdp_deepspeed.activation.api" not in graph[FACADE]  # lazy: inside functions only


def test_no_import_circle_in_the_package():
    assert find_cycle(import_graph()) is None, find_cycle(import_graph())


def test_the_circle_check_finds_circles():
    """Broken variants: the api <-> integrations circle this layering removed, and a longer one."""
    assert find_cycle({"api": {"hf", "stats"}, "hf": {"api"}, "stats": set()}) == ["api", "hf", "api"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


MAX_CORE_CLASS_LINES = 600


def long_classes(source: str, limit: int = MAX_CORE_CLASS_LINES) -> dict[str, int]:
    """Classes of ``source`` (nested ones too) longer than ``limit`` lines, decorators excluded, docstrings
    and blank lines included, by name."""
    return {node.name: node.end_lineno - node.lineno + 1 for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > limit}


def test_no_core_class_over_the_bound():
    offenders = {name: found for name, path in core_modules().items() if (found := long_classes(path.read_text()))}
    assert not offenders, offenders


def test_the_class_length_check_finds_long_classes():
    """Broken variants: a class one line over the bound (also nested in a function) is reported, one at it is not."""
    n = MAX_CORE_CLASS_LINES
    body = "".join(f"    x{i} = {i}\n" for i in range(n - 1))
    assert long_classes(f"class Ok:\n{body}") == {}
    assert long_classes(f"class Long:\n{body}    y = 0\n") == {"Long": n + 1}
    nested = "def f():\n" + "".join("    " + line + "\n" for line in f"class Inner:\n{body}    y = 0".splitlines())
    assert long_classes(nested) == {"Inner": n + 1}


def test_the_core_never_imports_tooling_integrations_or_the_startup_hook():
    def forbidden(name: str) -> bool:
        return _under(name, TOOLS) or _under(name, INTEGRATIONS) or name.split(".")[0] == STARTUP

    offenders = {name: sorted(n for n in imported_names(path, name) if forbidden(n))
                 for name, path in core_modules().items()}
    assert not {k: v for k, v in offenders.items() if v}, offenders


def test_nothing_in_the_package_imports_the_startup_hook_and_the_facade_no_tooling():
    for name, path in package_modules().items():
        assert not any(n.split(".")[0] == STARTUP for n in imported_names(path, name)), name
    assert not any(_under(n, TOOLS) for n in imported_names(PACKAGE_DIR / "__init__.py", FACADE))


def test_the_facade_is_lazy():
    """``fcdp_deepspeed/__init__.py`` imports nothing at module level but the standard library."""
    top = {n.split(".")[0] for n in module_level_imports(PACKAGE_DIR / "__init__.py", FACADE)}
    assert top <= set(sys.stdlib_module_names), top


def test_startup_hook_imports_only_the_standard_library():
    """The startup hook runs at every interpreter start (its .pth line): it, and every package module it
    imports, may import at module level nothing but the standard library and each other; the hook
    itself holds no logic (it calls into the package)."""
    graph = import_graph()
    reached = {n for n in imported_names(STARTUP_FILE, STARTUP) if _under(n, PACKAGE)}
    reached |= {PACKAGE}
    todo = list(reached)
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in reached:
                reached.add(nxt)
                todo.append(nxt)
    modules = package_modules()
    for name in reached:
        if name not in modules:
            continue
        top = {n.split(".")[0] for n in module_level_imports(modules[name], name)}
        assert top <= set(sys.stdlib_module_names) | {PACKAGE}, (name, top)
    assert reached <= STARTUP_MODULES, sorted(reached)
    assert len(STARTUP_FILE.read_text().splitlines()) <= 40


LOADED_AT_START = ("import json, sys; print(json.dumps(sorted(m for m in sys.modules "
                   "if m.split('.')[0] in ('torch', 'deepspeed', 'transformers', 'numpy', 'fcdp_deepspeed'))))")


def test_startup_hook_loads_no_torch_deepspeed_or_transformers():
    """What the startup hook loads in a fresh interpreter (run by hand, as the .pth line would)."""
    code = f"import {STARTUP}; {STARTUP}.startup(); {LOADED_AT_START}"
    env = dict(os.environ, FCDP_AUTOLOAD="1")
    proc = subprocess.run([sys.executable, "-S", "-c", code], env=env, capture_output=True, text=True, timeout=120,
                          cwd=str(ROOT))
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = set(eval(proc.stdout.strip().splitlines()[-1]))
    assert loaded == STARTUP_MODULES, loaded


BLOCKED_IMPORT = """
import importlib, importlib.abc, sys
BLOCKED = {blocked!r}
AT_START = set(sys.modules)  # the startup hook, loaded by its .pth line before this runs

class Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if any(name == b or name.startswith(b + ".") for b in BLOCKED):
            raise ImportError(f"the core imported {{name}}")
        return None

sys.meta_path.insert(0, Blocked())
for name in {modules!r}:
    importlib.import_module(name)
loaded = sorted(m for m in set(sys.modules) - AT_START if any(m == b or m.startswith(b + ".") for b in BLOCKED))
assert not loaded, loaded
print("core imported without the tooling and integrations:", len({modules!r}), "modules")
"""


def test_every_core_module_imports_with_tooling_and_integrations_unimportable():
    modules = sorted(core_modules())
    env = dict(os.environ, DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cpu"), FCDP_AUTOLOAD="0")
    code = BLOCKED_IMPORT.format(blocked=[TOOLS, INTEGRATIONS, STARTUP], modules=modules)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                          cwd=str(ROOT))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "core imported without the tooling" in proc.stdout


def test_integrations_import_their_framework_only_when_used():
    code = ("import sys, fcdp_deepspeed.integrations.hf as hf; assert 'transformers' not in sys.modules, 'at import'; "
            "hf.FCDPStatsCallback; assert 'transformers' in sys.modules; print('ok')")
    env = dict(os.environ, DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cpu"))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                          cwd=str(ROOT))
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


def ds_overrides_by_class(chain: tuple, base: type, plain: tuple = ()) -> dict[str, list[str]]:
    """DeepSpeed methods of ``base`` (and its bases) redefined by the classes of ``chain`` other than ``plain`` and
    DeepSpeed's own: method name -> the classes that define it."""
    ds_names = {name for cls in base.__mro__ for name in vars(cls)} - {"__init__", "__new__", "__doc__", "__module__",
                                                                          "__dict__", "__weakref__", "__qualname__"}
    found: dict[str, list[str]] = {}
    for cls in chain:
        if cls in plain or cls in base.__mro__:
            continue
        for name in vars(cls):
            if name in ds_names and callable(vars(cls)[name]):
                found.setdefault(name, []).append(cls.__name__)
    return found


def test_every_deepspeed_method_is_overridden_once_in_the_fcdp_chain():
    """The engine's order is written, not inherited (issue 47): no DeepSpeed stage-3 method is overridden by more than
    one class of the FCDP optimizer's chain (the counting class aside), and the phase is an enum."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from fcdp_deepspeed.engine.stage3 import CountedStage3, FCDPStage3, Phase
    found = ds_overrides_by_class(FCDPStage3.__mro__, DeepSpeedZeroOptimizer_Stage3, plain=(CountedStage3,))
    twice = {name: owners for name, owners in found.items() if len(owners) > 1}
    assert not twice, twice
    assert set(found["step"]) == {"FCDPStage3"} and set(found["_post_step"]) == {"FCDPStage3"}
    assert {p.name for p in Phase} >= {"TRAINING", "STEPPING", "CHECKPOINT"}

    # broken variant: a mixin that overrides a method the engine class overrides too is reported
    class Mixin:
        def _post_step(self, timer_names):  # pragma: no cover - never called
            pass

    class Twice(FCDPStage3, Mixin):
        pass
    assert "_post_step" in {n for n, o in ds_overrides_by_class(Twice.__mro__, DeepSpeedZeroOptimizer_Stage3,
                                                                 plain=(CountedStage3,)).items() if len(o) > 1}
