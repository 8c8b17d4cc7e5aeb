"""Config-key-only activation, the hard way: this package pip-installed into an environment that already
has torch and DeepSpeed, as a wheel and then editable (PEP 660), and the unmodified ``examples/train_toy.py``
(no FCDP code) launched by torchrun and by the deepspeed launcher with the block on and off. FCDP's
optimizer class must be built exactly when the block is enabled, in every rank, and a process that never
imports DeepSpeed must not import torch, DeepSpeed or transformers (of this package, only the startup modules).

[Note: the user's environment] The fresh venv (no pip of its own) sees the test suite's venv through a
``.pth`` line, the way a user's environment already holds torch and DeepSpeed: pip then installs the wheel
(from the session's ``dists`` fixture, built once) and nothing else (checked with ``--report``), and the ranks
import the suite's torch and DeepSpeed from the same paths, so DeepSpeed's CPU comm op built for the suite
(``TORCH_EXTENSIONS_DIR``, as ``scripts/test.sh`` sets it) loads without a rebuild. A ``.pth`` *path* line
adds the directory to ``sys.path`` only: the suite's own startup and editable-finder ``.pth`` files in it do
not run. Before this, the test installed torch and DeepSpeed into the venv and JIT-built the op itself.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import time
import venv
from pathlib import Path

import pytest

from fcdp_lab.harness.launch import free_port
from fcdp_deepspeed.version import __version__

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "train_toy.py"
HEAVY = ("torch", "deepspeed", "transformers", "numpy")
#: What the startup hook loads of this package: its lazy ``__init__`` and standard-library-only modules.
STARTUP_MODULES = ["fcdp_deepspeed", "fcdp_deepspeed.activation", "fcdp_deepspeed.activation.autoload",
                   "fcdp_deepspeed.activation.post_import", "fcdp_deepspeed.activation.version_gate",
                   "fcdp_deepspeed.integrations"]
KNOWN_EXIT_ABORT = "terminate called without an active exception"


def _run(cmd: list, env: dict, timeout: float = 600, cwd: Path | None = None, check: bool = True) -> str:
    proc = subprocess.Popen([str(c) for c in cmd], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=str(cwd) if cwd else None, start_new_session=True)  # a timeout kills launcher and ranks
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, cmd))} exited {proc.returncode}:\n{out[-4000:]}")
    return out


def suite_extensions_dir() -> str:
    """Where the suite's DeepSpeed JIT ops live (``scripts/test.sh`` sets it; else the same default)."""
    return os.environ.get("TORCH_EXTENSIONS_DIR") or str(Path(sys.prefix) / "torch_extensions")


class UserEnv:
    """A venv outside the repository that already sees torch and DeepSpeed (the suite's, see the module note)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        t0 = time.monotonic()
        venv.create(root / "venv", with_pip=False, symlinks=True)
        self.python = root / "venv" / "bin" / "python"
        self.env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "FCDP_AUTOLOAD")}
        # [Note: the suite's ninja first] ninja 1.11 and 1.13 hash build commands differently, so an op built
        # with one is rebuilt by the other: the ranks use the ninja the suite built its op with.
        path = os.pathsep.join([str(Path(sys.executable).parent), self.env.get("PATH", "")])
        self.env.update(DS_ACCELERATOR="cpu", PYTHONWARNINGS="ignore::FutureWarning", PATH=path,
                        TORCH_EXTENSIONS_DIR=suite_extensions_dir(), PYTHONDONTWRITEBYTECODE="1")
        self.site = Path(self.python_c("import sysconfig; print(sysconfig.get_paths()['purelib'])").strip())
        (self.site / "_existing_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
        self.timings: dict[str, float] = {"venv": round(time.monotonic() - t0, 1)}

    def timed(self, name: str, cmd: list, **kw) -> str:
        t0 = time.monotonic()
        out = _run(cmd, self.env, **kw)
        self.timings[name] = round(time.monotonic() - t0, 1)
        return out

    def pip(self, name: str, *args: str) -> str:
        return self.timed(name, [self.python, "-m", "pip", "install", "-q", *args], cwd=self.root)

    def python_c(self, code: str, **env: str) -> str:
        return _run([self.python, "-c", code], dict(self.env, **env), cwd=self.root)


@pytest.fixture(scope="module")
def fresh(tmp_path_factory, dists) -> UserEnv:
    v = UserEnv(tmp_path_factory.mktemp("fresh"))
    v.timings["build sdist + wheel (session)"] = dists["seconds"]
    report = v.root / "install.json"
    # offline: everything the wheel needs is already installed, so pip must not need an index
    v.pip("install wheel", "--no-index", "--report", str(report), str(dists["wheel"]))
    installed = [(i["metadata"]["name"], i["metadata"]["version"]) for i in json.loads(report.read_text())["install"]]
    assert installed == [("fcdp-deepspeed", __version__)], installed  # torch, DeepSpeed and the rest kept
    # DeepSpeed's CPU comm op: the suite's build (same torch, same paths), or built once here for both
    v.timed("shm op (the suite's)", [v.python, "-c", "from deepspeed.comm.torch import build_shm_op; build_shm_op()"])
    yield v
    print(f"\nfresh-venv timings (s): {v.timings}")


@pytest.fixture(scope="module", params=["wheel", "editable"])
def installed(request, fresh: UserEnv) -> str:
    if request.param == "editable":
        out = fresh.pip("install editable", "--no-deps", "-e", str(ROOT))
        assert "Editable installation" not in out and "BuildBackendWarning" not in out, out  # setup.py's [Note]
    return request.param


def test_startup_hook_is_installed_and_cheap(fresh, installed):
    site = fresh.site
    pth = site / "fcdp_deepspeed_autoload.pth"
    assert pth.read_text().strip() == "import fcdp_deepspeed_autoload; fcdp_deepspeed_autoload.startup()"
    record = next(site.glob("fcdp_deepspeed-*.dist-info")) / "RECORD"
    assert "fcdp_deepspeed_autoload.pth," in record.read_text()  # pip uninstall removes it
    origin = fresh.python_c("import fcdp_deepspeed_autoload as m; print(m.__file__)").strip()
    assert origin.startswith(str(ROOT) if installed == "editable" else str(site)), origin
    probe = ("import json, sys; print(json.dumps([sorted(m for m in sys.modules if m.split('.')[0] in %r), "
             "sorted(m for m in sys.modules if m.split('.')[0] == 'fcdp_deepspeed'), "
             "'fcdp_deepspeed_autoload' in sys.modules, type(sys.meta_path[0]).__name__]))" % (HEAVY, ))
    loaded, ours, hook_ran, first_finder = json.loads(fresh.python_c(probe).strip().splitlines()[-1])
    assert loaded == [] and ours == STARTUP_MODULES and hook_ran and first_finder == "_PostImportFinder"


def test_importing_deepspeed_installs_fcdp_unless_opted_out(fresh, installed):
    code = "import deepspeed, fcdp_deepspeed; print('INSTALLED', fcdp_deepspeed.is_installed())"
    assert "INSTALLED True" in fresh.python_c(code)
    assert "INSTALLED False" in fresh.python_c(code, FCDP_AUTOLOAD="0")


def test_console_script_and_doctor_from_the_wheel(fresh, installed):
    """``fcdp --version``, ``fcdp configs`` and ``fcdp doctor`` as installed (console script): the wheel ships
    the configs (``fcdp configs`` copies one out), and everything is ok for it."""
    if installed != "wheel":
        pytest.skip("the wheel's console script; the editable install replaces it with the same entry point")
    fcdp = fresh.python.parent / "fcdp"
    assert _run([fcdp, "--version"], fresh.env).strip() == f"fcdp-deepspeed {__version__}"
    listed = _run([fcdp, "configs"], fresh.env, cwd=fresh.root)
    assert f"{fresh.site}/fcdp_deepspeed/shipped/configs/toy_fcdp.json" in listed and "examples/train_toy.py" in listed
    _run([fcdp, "configs", "toy_fcdp.json"], fresh.env, cwd=fresh.root)  # into the current folder
    out = _run([fcdp, "doctor", fresh.root / "toy_fcdp.json", "--nodes", "2", "--ranks-per-node", "1"],
               fresh.env, cwd=fresh.root)
    assert "0 failed" in out and "startup file ran in this interpreter" in out and "plan for 2 nodes x 1" in out, out


def test_doctor_names_a_target_install_without_the_startup_file(fresh, dists, tmp_path):
    """``pip install --target`` + ``PYTHONPATH`` puts no startup file where Python runs it: DeepSpeed would
    ignore the block. ``fcdp doctor`` says so and names the fix (exit status 1)."""
    target = tmp_path / "target"
    _run([fresh.python, "-m", "pip", "install", "-q", "--no-deps", "--target", target, dists["wheel"]], fresh.env)
    bare = tmp_path / "bare"
    venv.create(bare, with_pip=False, symlinks=True)
    site = next((bare / "lib").glob("python3*/site-packages"))
    (site / "_existing_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")  # torch, DeepSpeed, pip
    env = dict(fresh.env, PYTHONPATH=str(target))
    proc = subprocess.run([bare / "bin" / "python", "-m", "fcdp_deepspeed.tools.doctor"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAIL  startup  no fcdp_deepspeed_autoload.pth" in proc.stdout and "--target" in proc.stdout, proc.stdout


def _config(tmp: Path, enabled: bool) -> Path:
    cfg = json.loads((ROOT / "configs" / "toy_fcdp.json").read_text())  # strict JSON, as shipped
    if enabled:
        # two ranks on one machine are one node, where FCDP takes no memory: simulate 2 nodes x 1 so the cache runs
        cfg["fcdp"]["ranks_per_node"] = 1
    else:
        cfg.pop("fcdp")
    path = tmp / f"ds_{'on' if enabled else 'off'}.json"
    path.write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize("launcher", ["torchrun", "deepspeed"])
def test_unmodified_script_under_launcher(fresh, installed, launcher, tmp_path):
    """[Note: pairs, not the full product] Each launch costs a launcher and two ranks importing torch and
    DeepSpeed (~15 CPU s). Four launches cover every pair of (install, launcher, block): the wheel with
    torchrun on and deepspeed off, the editable install with torchrun off and deepspeed on; each install
    and each launcher runs the block both on and off."""
    enabled = (installed == "wheel") == (launcher == "torchrun")
    assert "fcdp" not in SCRIPT.read_text().split('"""', 2)[2].split("try:")[0]  # no FCDP code before the report
    out = tmp_path / "result.json"
    args = [SCRIPT, "--deepspeed_config", _config(tmp_path, enabled), "--steps", "2", "--out", out]
    port = str(free_port())
    if launcher == "torchrun":
        cmd = [fresh.python, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", port, *args]
    else:
        cmd = [fresh.python, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", port, *args]
    t0 = time.monotonic()
    try:
        log = _run(cmd, fresh.env, timeout=300, cwd=tmp_path)
    except AssertionError as err:  # gloo ranks can abort in teardown after writing the results
        if KNOWN_EXIT_ABORT not in str(err) or not out.exists():
            raise
        log = str(err)
    fresh.timings[f"{installed} {launcher} {'on' if enabled else 'off'}"] = round(time.monotonic() - t0, 1)
    ranks = json.loads(out.read_text())
    assert len(ranks) == 2
    for r in ranks:
        assert r["optimizer"] == ("FCDPStage3" if enabled else "CountedStage3"), r
        assert (r["cache_hits"] > 0) == enabled, r
    # "Is it on?": the one WARNING line of an FCDP engine, at DeepSpeed's default log level
    assert (log.count("fcdp: ON for this engine: 2 nodes x 1 rank per node") == 1) == enabled, log[-3000:]
