"""The package as pip sees it: metadata, what the sdist and the wheel hold, and that installing it keeps the
torch and DeepSpeed an environment already has.

The sdist and the wheel come from ``python -m build`` (the ``dists`` fixture: the wheel is built from the
sdist, so it also proves the sdist builds). The metadata check is what ``twine check`` does for a Markdown
README (the fields parse and validate as core metadata, the description has a content type), plus the
fields this project promises. The resolution tests give pip environments made of metadata-only stand-in
distributions (``*.dist-info`` with a ``METADATA`` file, no code) and ask ``pip install --dry-run --report``,
offline (``--no-index``, no pip configuration), what it would install: nothing but fcdp-deepspeed.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import tomllib
import venv
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from packaging.metadata import Metadata
from packaging.requirements import Requirement

from fcdp_deepspeed.activation import version_gate
from fcdp_deepspeed.activation.version_gate import TESTED_DEEPSPEED_VERSIONS, TESTED_TORCH_VERSION, deepspeed_requirement
from fcdp_deepspeed.version import __version__

ROOT = Path(__file__).resolve().parent.parent
PTH_LINE = "import fcdp_deepspeed_autoload; fcdp_deepspeed_autoload.startup()"


def wheel_metadata(wheel: Path) -> Metadata:
    with zipfile.ZipFile(wheel) as z:
        raw = z.read(f"fcdp_deepspeed-{__version__}.dist-info/METADATA")
    return Metadata.from_email(raw, validate=True)  # raises on any invalid core-metadata field


def test_metadata_is_complete_and_valid(dists):
    meta = wheel_metadata(dists["wheel"])
    assert (meta.name, str(meta.version)) == ("fcdp-deepspeed", __version__)  # one version source
    assert meta.license_expression == "Apache-2.0" and meta.license_files == ["LICENSE"]
    assert meta.author and meta.summary and meta.keywords and meta.project_urls
    assert str(meta.requires_python) == ">=3.10"
    assert {"Programming Language :: Python :: 3.10", "Programming Language :: Python :: 3.11"} <= set(meta.classifiers)
    assert meta.description_content_type == "text/markdown" and meta.description.startswith("# fcdp-deepspeed")
    requires = {Requirement(str(r)).name: Requirement(str(r)) for r in meta.requires_dist if not r.marker}
    assert str(requires["deepspeed"].specifier) == str(Requirement(deepspeed_requirement()).specifier)
    assert str(requires["torch"].specifier) == ">=2.0"


def test_sdist_and_wheel_hold_what_they_need(dists):
    with tarfile.open(dists["sdist"]) as t:
        names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    for needed in ("LICENSE", "CHANGELOG.md", "README.md", "constraints.txt", "pyproject.toml", "setup.py",
                   "fcdp_deepspeed_autoload.py", "fcdp_deepspeed/version.py", "configs/toy_fcdp.json",
                   "examples/train_toy.py"):
        assert needed in names, needed
    with zipfile.ZipFile(dists["wheel"]) as z:
        files = set(z.namelist())
        assert z.read("fcdp_deepspeed_autoload.pth").decode().strip() == PTH_LINE  # at the root: site-packages
        record = z.read(f"fcdp_deepspeed-{__version__}.dist-info/RECORD").decode()
    assert "fcdp_deepspeed_autoload.pth," in record  # pip uninstall removes it
    assert f"fcdp_deepspeed-{__version__}.dist-info/licenses/LICENSE" in files
    assert "fcdp_deepspeed/tools/doctor.py" in files and not any(f.startswith("tests/") for f in files)
    # The wheel holds the plugin, not the lab: no harness, bench, fuzz, reliability, GPU-check, convergence or
    # strict-model module, no broken variant, and at most 15k lines of Python (14k before layered accumulation, whose
    # package, config block and planner rows are about 500).
    lab = [f for f in files if f.startswith("fcdp_lab/") or any(
        part in f for part in ("/harness/", "/bench/", "/fuzz/", "/reliability/", "/gpu/", "/converge/", "strict_"))]
    assert not lab, lab
    with zipfile.ZipFile(dists["wheel"]) as z:
        texts = {f: z.read(f).decode(errors="replace") for f in files if f.endswith((".py", ".c", ".json", ".pth"))}
    assert not [f for f, text in texts.items() if "FCDP_BREAK" in text], "a broken variant ships in the wheel"
    lines = sum(text.count("\n") for f, text in texts.items() if f.endswith(".py"))
    assert lines <= 15_000, lines
    assert "fcdp_deepspeed/activation/deepspeed_releases.json" in files and "fcdp_deepspeed/activation/deepspeed_releases.json" in names
    shipped = {f.split("/", 2)[2] for f in files if f.startswith("fcdp_deepspeed/shipped/")}
    assert shipped == {f"{d}/{p.name}" for d, suffix in (("configs", ".json"), ("examples", ".py"))
                       for p in (ROOT / d).glob(f"*{suffix}")}, shipped  # every config and example, as in the sdist


PY310 = Path("/root/.pyenv/versions/3.10.13/bin/python3.10")


@pytest.mark.skipif(not PY310.exists(), reason="no Python 3.10 on this machine")
def test_python_3_10_installs_the_wheel_and_finds_the_shipped_configs(dists, tmp_path):
    """What ``requires-python >=3.10`` and the 3.10 classifier claim: the wheel installs into a Python 3.10 venv
    (``--no-deps``: no torch for 3.10 here), every module byte-compiles, and the standard-library parts run:
    the version gate reads its table, ``fcdp configs`` lists the shipped configs and copies one out."""
    subprocess.run([PY310, "-m", "venv", tmp_path / "py310"], check=True, timeout=300)
    py = tmp_path / "py310" / "bin" / "python"
    env = offline_pip_env()
    pip = subprocess.run([py, "-m", "pip", "install", "-q", "--no-deps", str(dists["wheel"])], env=env,
                         capture_output=True, text=True, timeout=300)
    assert pip.returncode == 0, pip.stderr[-2000:]
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    compiled = subprocess.run([py, "-m", "compileall", "-q", f"{site}/fcdp_deepspeed"], capture_output=True, text=True)
    assert compiled.returncode == 0, compiled.stdout[-3000:]
    code = ("from fcdp_deepspeed.activation import version_gate as g; print(','.join(g.TESTED_DEEPSPEED_VERSIONS)); "
            "from fcdp_deepspeed.tools import configs; raise SystemExit(configs.main(['toy_fcdp.json', '--to', 'out']))")
    run = subprocess.run([py, "-c", code], cwd=tmp_path, env=dict(env, FCDP_AUTOLOAD="0"), capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.splitlines()[0] == ",".join(TESTED_DEEPSPEED_VERSIONS) and "shipped/configs/toy_fcdp.json" in run.stdout
    assert json.loads((tmp_path / "out" / "toy_fcdp.json").read_text()) == json.loads(
        (ROOT / "configs" / "toy_fcdp.json").read_text())


def test_ranges_pins_and_gate_agree():
    """pyproject declares ranges; constraints.txt pins the main suite's releases; the gate's tested
    releases all lie in the declared range, and the nearest untested ones do not."""
    deps = {Requirement(d).name: Requirement(d) for d in tomllib.loads((ROOT / "pyproject.toml").read_text())
            ["project"]["dependencies"]}
    assert str(deps["deepspeed"]) == str(Requirement(deepspeed_requirement()))
    spec = deps["deepspeed"].specifier
    assert all(v in spec for v in TESTED_DEEPSPEED_VERSIONS) and "0.16.8" not in spec and "0.20.0" not in spec
    table = version_gate.load()
    # exactly the releases the table records as passed: every other release of the range is excluded
    assert [v for v in table["candidates"] if v in spec] == sorted(TESTED_DEEPSPEED_VERSIONS, key=version_gate.release_key)
    assert all(v in deps["torch"].specifier for v in (TESTED_TORCH_VERSION, "2.14.0", "2.15.0"))
    pins = [line for line in (ROOT / "constraints.txt").read_text().splitlines() if line and not line.startswith("#")]
    assert pins == [f"torch=={TESTED_TORCH_VERSION}", f"deepspeed=={TESTED_DEEPSPEED_VERSIONS[-1]}"]
    setup_env = (ROOT / "scripts" / "setup_env.sh").read_text()
    assert setup_env.count("-c constraints.txt") == 2  # torch first, then the package, both pinned
    assert "==" not in "".join(d for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"])


def test_the_release_table_in_the_docs_is_the_gates():
    """docs/deepspeed-releases.md shows the table the gate reads (scripts/check_all_releases.py writes both)."""
    text = (ROOT / "docs" / "deepspeed-releases.md").read_text()
    shown = text.split(version_gate.BEGIN, 1)[1].split(version_gate.END, 1)[0].strip()
    table = version_gate.load()
    assert shown == version_gate.markdown(table)
    assert sorted(table["candidates"], key=version_gate.release_key) == table["candidates"] and \
        set(table["results"]) <= set(table["candidates"])


def stand_in_env(root: Path, dists: dict[str, str]) -> Path:
    """A venv without pip whose site-packages holds metadata-only distributions ``name -> version``."""
    venv.create(root, with_pip=False, symlinks=True)
    site = next((root / "lib").glob("python3*/site-packages"))
    for name, version in dists.items():
        info = site / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        (info / "INSTALLER").write_text("stand-in\n")
        (info / "RECORD").write_text("")
    return root / "bin" / "python"


def offline_pip_env() -> dict:
    """No pip configuration (this machine's caps and indexes), no index, no ``PYTHONPATH`` (a checkout's
    ``*.egg-info`` on it counts as installed): pip sees only the stand-in environment."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") and k != "PYTHONPATH"}
    return dict(env, PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1")


def dry_run(python: Path, target: str, report: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pip", "--python", str(python), "install", "--dry-run", "--quiet",
           "--report", str(report), target]
    return subprocess.run(cmd, env=offline_pip_env(), capture_output=True, text=True, timeout=300)


#: What a user's environment may hold, beside fcdp-deepspeed's other requirements.
STACKS = {f"torch {t} + deepspeed {d}": {"torch": f"{t}.0", "deepspeed": d}
          for t, d in zip(("2.14", "2.15", "2.13", "2.15"), reversed(TESTED_DEEPSPEED_VERSIONS))}  # admitted ones
OTHERS = {"pydantic": "2.11.0", "hjson": "3.1.0", "psutil": "7.0.0", "py-cpuinfo": "9.0.0"}
#: Environments the declared range must refuse (pip cannot satisfy it offline): outside 0.16.9 .. < 0.20.
REFUSED = {"deepspeed 0.15.4": {"torch": "2.13.0", "deepspeed": "0.15.4"},
           "deepspeed 0.20.0": {"torch": "2.13.0", "deepspeed": "0.20.0"}}
#: ... and the newest release inside it that the gate does not admit (failed or not run: the issue's 0.17.5).
_GAPS = [v for v in version_gate.load()["candidates"] if v not in TESTED_DEEPSPEED_VERSIONS]
if _GAPS:
    REFUSED[f"deepspeed {_GAPS[-1]} (not admitted)"] = {"torch": "2.13.0", "deepspeed": _GAPS[-1]}


HF_TESTED = {"transformers": "5.25.0", "peft": "0.21.2", "accelerate": "1.16.0"}
#: The [hf] extra: the stack the suite runs is kept; an older torch or transformers is refused, not replaced.
HF_CASES = {"tested HF stack, torch 2.13": ({"torch": "2.13.0", **HF_TESTED}, True),
            "tested HF stack, torch 2.5.1": ({"torch": "2.5.1", **HF_TESTED}, False),
            "transformers 4.46.3, torch 2.13": ({"torch": "2.13.0", **HF_TESTED, "transformers": "4.46.3"}, False)}


def test_hf_extra_keeps_the_tested_stack_and_refuses_others(dists, tmp_path):
    """``pip install "fcdp-deepspeed[hf]"`` resolved like the base install: with the tested HF stack and torch it
    installs fcdp-deepspeed alone; with torch 2.5.1 (below accelerate 1.16's floor) or an older transformers,
    offline pip refuses instead of resolving to a set nobody ran."""
    deepspeed = {"deepspeed": TESTED_DEEPSPEED_VERSIONS[-1]}
    pythons = {name: stand_in_env(tmp_path / f"hf{i}", {**OTHERS, **deepspeed, **stack})
               for i, (name, (stack, _)) in enumerate(HF_CASES.items())}
    target = f"fcdp-deepspeed[hf] @ {dists['wheel'].as_uri()}"
    with ThreadPoolExecutor(max_workers=3) as pool:
        procs = dict(zip(HF_CASES, pool.map(lambda n: dry_run(pythons[n], target, tmp_path / f"{n}.json"), HF_CASES)))
    for name, (_, kept) in HF_CASES.items():
        if kept:
            assert procs[name].returncode == 0, (name, procs[name].stderr[-2000:])
            report = json.loads((tmp_path / f"{name}.json").read_text())
            assert [i["metadata"]["name"] for i in report["install"]] == ["fcdp-deepspeed"], (name, report["install"])
        else:
            assert procs[name].returncode != 0, (name, procs[name].stdout[-2000:])


def test_pip_keeps_the_torch_and_deepspeed_already_installed(dists, tmp_path):
    """Each stack resolves to installing fcdp-deepspeed alone (torch and DeepSpeed kept as they are); a
    DeepSpeed outside the declared range is refused at install time instead of replaced silently."""
    cases = {**STACKS, **REFUSED}
    pythons = {name: stand_in_env(tmp_path / f"env{i}", {**OTHERS, **stack}) for i, (name, stack) in enumerate(cases.items())}
    with ThreadPoolExecutor(max_workers=3) as pool:  # each pip run is ~2 CPU s of startup
        procs = dict(zip(cases, pool.map(lambda n: dry_run(pythons[n], str(dists["wheel"]), tmp_path / f"{n}.json"),
                                         cases)))
    for name in STACKS:
        assert procs[name].returncode == 0, (name, procs[name].stdout[-2000:], procs[name].stderr[-2000:])
        report = json.loads((tmp_path / f"{name}.json").read_text())
        installs = [(i["metadata"]["name"], i["metadata"]["version"]) for i in report["install"]]
        assert installs == [("fcdp-deepspeed", __version__)], (name, installs)
    for name in REFUSED:
        assert procs[name].returncode != 0 and "deepspeed" in procs[name].stderr.lower(), (name, procs[name].stderr)


@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="not a git checkout")
def test_git_url_install_resolves(tmp_path):
    """The README's git install: pip clones the committed HEAD and builds its metadata (dry run, no deps)."""
    report = tmp_path / "git.json"
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--no-deps", "--report", str(report),
           f"git+file://{ROOT}"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # a checkout on it would count as installed
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (item,) = json.loads(report.read_text())["install"]
    assert item["metadata"]["name"] == "fcdp-deepspeed" and item["metadata"]["version"] == __version__
