"""Config-key-only activation, the hard way: a fresh venv, this package pip-installed as a wheel and
then editable (PEP 660), and the unmodified ``examples/train_toy.py`` (no FCDP code) launched by
torchrun and by the deepspeed launcher with the block on and off. FCDP's optimizer class must be
built exactly when the block is enabled, in every rank, and a process that never imports DeepSpeed
must not import torch, DeepSpeed or transformers (of this package, only the startup modules).

One venv per test session (module-scoped fixture): ``pip install torch==2.13.0`` (the exact pin
resolves to a local CPU wheel), then the package's wheel with its dependencies, then ``pip install
--no-deps -e .`` over it. The launcher runs cover every pair of (install, launcher, block on/off) in
four launches (see the note at the launcher test).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import venv
from pathlib import Path

import pytest

from fcdp_deepspeed.tools.launch import free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "train_toy.py"
TORCH_PIN = "torch==2.13.0"
HEAVY = ("torch", "deepspeed", "transformers", "numpy")
#: What the startup hook loads of this package: its lazy ``__init__`` and standard-library-only modules.
STARTUP_MODULES = ["fcdp_deepspeed", "fcdp_deepspeed.autoload", "fcdp_deepspeed.integrations",
                   "fcdp_deepspeed.post_import", "fcdp_deepspeed.version_gate"]
KNOWN_EXIT_ABORT = "terminate called without an active exception"


def _run(cmd: list, env: dict, timeout: float = 600, cwd: Path | None = None) -> str:
    proc = subprocess.Popen([str(c) for c in cmd], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=str(cwd) if cwd else None, start_new_session=True)  # a timeout kills launcher and ranks
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, cmd))} exited {proc.returncode}:\n{out[-4000:]}")
    return out


class FreshVenv:
    """A venv outside the repository with its own torch extensions dir (the JIT op is built per venv)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.python = root / "venv" / "bin" / "python"
        self.env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "FCDP_AUTOLOAD")}
        self.env.update(DS_ACCELERATOR="cpu", PYTHONWARNINGS="ignore::FutureWarning",
                        TORCH_EXTENSIONS_DIR=str(root / "torch_extensions"), PYTHONDONTWRITEBYTECODE="1")
        self.timings: dict[str, float] = {}

    def timed(self, name: str, cmd: list, **kw) -> str:
        t0 = time.monotonic()
        out = _run(cmd, self.env, **kw)
        self.timings[name] = round(time.monotonic() - t0, 1)
        return out

    def pip(self, name: str, *args: str) -> str:
        return self.timed(name, [self.python, "-m", "pip", "install", "-q", *args], cwd=self.root)

    def python_c(self, code: str, **env: str) -> str:
        return _run([self.python, "-c", code], dict(self.env, **env), cwd=self.root)

    def site_packages(self) -> Path:
        return Path(self.python_c("import sysconfig; print(sysconfig.get_paths()['purelib'])").strip())


@pytest.fixture(scope="module")
def fresh(tmp_path_factory) -> FreshVenv:
    v = FreshVenv(tmp_path_factory.mktemp("fresh"))
    t0 = time.monotonic()
    venv.create(v.root / "venv", with_pip=True)
    v.timings["venv"] = round(time.monotonic() - t0, 1)
    v.pip("torch", TORCH_PIN)
    v.timed("build wheel", [v.python, "-m", "pip", "wheel", "-q", "--no-deps", "-w", v.root / "dist", ROOT], cwd=v.root)
    wheel = next((v.root / "dist").glob("fcdp_deepspeed-*.whl"))
    v.pip("install wheel (deepspeed and deps)", str(wheel))
    # DeepSpeed's CPU comm op, built once here rather than raced by the first launch's ranks
    v.timed("jit op", [v.python, "-c", "from deepspeed.comm.torch import build_shm_op; build_shm_op()"])
    yield v
    print(f"\nfresh-venv timings (s): {v.timings}")


@pytest.fixture(scope="module", params=["wheel", "editable"])
def installed(request, fresh: FreshVenv) -> str:
    if request.param == "editable":
        fresh.pip("install editable", "--no-deps", "-e", str(ROOT))
    return request.param


def test_startup_hook_is_installed_and_cheap(fresh, installed):
    site = fresh.site_packages()
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


def _config(tmp: Path, enabled: bool) -> Path:
    cfg = json.loads("\n".join(line.split("//")[0] for line in (ROOT / "configs" / "toy_fcdp.json").read_text().splitlines()))
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
    DeepSpeed in the fresh venv (~15 CPU s). Four launches cover every pair of (install, launcher, block):
    the wheel with torchrun on and deepspeed off, the editable install with torchrun off and deepspeed on;
    each install and each launcher runs the block both on and off."""
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
        _run(cmd, fresh.env, timeout=300, cwd=tmp_path)
    except AssertionError as err:  # gloo ranks can abort in teardown after writing the results
        if KNOWN_EXIT_ABORT not in str(err) or not out.exists():
            raise
    fresh.timings[f"{installed} {launcher} {'on' if enabled else 'off'}"] = round(time.monotonic() - t0, 1)
    ranks = json.loads(out.read_text())
    assert len(ranks) == 2
    for r in ranks:
        assert r["optimizer"] == ("FCDPStage3" if enabled else "CountedStage3"), r
        assert (r["cache_hits"] > 0) == enabled, r
