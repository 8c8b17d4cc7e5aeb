"""fcdp-deepspeed's build hook: the startup file (``fcdp_deepspeed_autoload.pth``) in wheels and editable
installs. Everything else (name, version, dependencies, metadata) is declared in ``pyproject.toml``."""
import os

from setuptools import setup
from setuptools.command.build_py import build_py

# Config-key-only activation (see fcdp_deepspeed_autoload.py): Python's `site` runs this line at every
# interpreter start. It must sit in site-packages itself, for wheel and editable installs alike.
AUTOLOAD_PTH = "fcdp_deepspeed_autoload.pth"
AUTOLOAD_LINE = "import fcdp_deepspeed_autoload; fcdp_deepspeed_autoload.startup()\n"


#: The shipped configs and examples (``fcdp configs`` finds them): checkout folder -> (package folder, suffix).
SHIPPED = {"configs": ".json", "examples": ".py"}
SHIPPED_DIR = os.path.join("fcdp_deepspeed", "shipped")


def _shipped_files():
    """(source, path under build_lib) of each shipped file; the sdist holds the folders (MANIFEST.in)."""
    here = os.path.dirname(os.path.abspath(__file__))
    return [(os.path.join(here, folder, name), os.path.join(SHIPPED_DIR, folder, name))
            for folder, suffix in SHIPPED.items() if os.path.isdir(os.path.join(here, folder))
            for name in sorted(os.listdir(os.path.join(here, folder))) if name.endswith(suffix)]


class BuildPyWithAutoload(build_py):
    """Wheels: the startup file goes to the root of build_lib, i.e. into site-packages; the configs and
    examples into ``fcdp_deepspeed/shipped/`` (an editable install finds them in the checkout instead)."""

    def run(self):
        super().run()
        if not self.editable_mode:  # editable wheels get it from EditableWheelWithAutoload
            with open(os.path.join(self.build_lib, AUTOLOAD_PTH), "w") as f:
                f.write(AUTOLOAD_LINE)
            for source, dest in _shipped_files():
                self.mkpath(os.path.dirname(os.path.join(self.build_lib, dest)))
                self.copy_file(source, os.path.join(self.build_lib, dest))

    def get_outputs(self, include_bytecode=1):
        extra = [] if self.editable_mode else [os.path.join(self.build_lib, AUTOLOAD_PTH)] + [
            os.path.join(self.build_lib, dest) for _, dest in _shipped_files()]
        return super().get_outputs(include_bytecode) + extra


cmdclass = {"build_py": BuildPyWithAutoload}
try:
    from setuptools.command.editable_wheel import editable_wheel
except ImportError:  # setuptools < 64: `pip install -e` runs `develop`, which has no startup file
    editable_wheel = None

if editable_wheel is not None:

    class _StrategyWithAutoload:
        """Wraps setuptools' editable strategy: its files, plus the startup file at the wheel root
        (no editable strategy copies build_lib files there, and a .pth only works in site-packages)."""

        def __init__(self, strategy):
            self.strategy = strategy

        def __call__(self, wheel, files, mapping):
            self.strategy(wheel, files, mapping)
            wheel.writestr(AUTOLOAD_PTH, AUTOLOAD_LINE.encode())

        def __enter__(self):
            self.strategy.__enter__()
            return self

        def __exit__(self, *exc):
            # [Note: the editable-install notice] setuptools' meta-path strategy ends with an InformationOnly
            # warning box ("Please be careful with folders in your working directory with the same name as
            # your package"), which pip shows as a BuildBackendWarning on every `pip install -e .` (demo.sh,
            # setup_env.sh). Here the folder of that name is the checkout's package itself, the one the
            # install points at, so the notice is filtered for this call only, by its category and summary.
            import warnings
            with warnings.catch_warnings():
                try:
                    from setuptools.warnings import InformationOnly
                except ImportError:  # older setuptools: no such notice
                    InformationOnly = Warning
                warnings.filterwarnings("ignore", message=r"Editable installation\.", category=InformationOnly)
                return self.strategy.__exit__(*exc)

    class EditableWheelWithAutoload(editable_wheel):
        """PEP 660 editable installs (``pip install -e .``) with the startup file."""

        def run(self):
            if not hasattr(editable_wheel, "_select_strategy"):
                print(f"WARNING: this setuptools has no editable_wheel._select_strategy; {AUTOLOAD_PTH} is not "
                      f"installed, so the fcdp block needs fcdp_deepspeed.install() or `-m fcdp_deepspeed.run`.")
            super().run()

        def _select_strategy(self, name, tag, build_lib):
            return _StrategyWithAutoload(super()._select_strategy(name, tag, build_lib))

    cmdclass["editable_wheel"] = EditableWheelWithAutoload

# Metadata, dependencies and the version live in pyproject.toml; this file only adds the startup file.
setup(cmdclass=cmdclass)
