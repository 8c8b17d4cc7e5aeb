"""fcdp-deepspeed: Fully Cached Data Parallel (node-local parameter cache) for DeepSpeed ZeRO-3."""
from setuptools import find_packages, setup

# The DeepSpeed releases the hooks were tested against (checked again at import).
DEEPSPEED_PIN = "deepspeed==0.19.8"
# This exact pin installs a CPU build from local disk here; a looser spec pulls a CUDA build.
TORCH_PIN = "torch==2.13.0"

setup(
    name="fcdp-deepspeed",
    version="0.1.0",
    description="Fully Cached Data Parallel: a node-local parameter cache for DeepSpeed ZeRO-3 on slow inter-node links",
    long_description=open("README.md").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["fcdp_deepspeed", "fcdp_deepspeed.*"]),
    python_requires=">=3.10",
    install_requires=[TORCH_PIN, DEEPSPEED_PIN, "pydantic>=2", "hjson", "psutil", "py-cpuinfo"],
    extras_require={
        "test": ["pytest>=8", "pytest-timeout"],
        "bench": ["matplotlib", "rich"],
        "hf": ["transformers", "peft", "accelerate"],
    },
    entry_points={"console_scripts": ["fcdp=fcdp_deepspeed.tools.cli:main"]},
)
