"""Install script for kfac_optim (src layout; the core depends on torch only)."""

from pathlib import Path

from setuptools import find_packages, setup

EXAMPLES = ["torchvision", "scikit-learn", "pyyaml", "tqdm", "matplotlib"]
DEV = EXAMPLES + ["pytest"]
PEERS = ["heavyball"]  # SOAP for `python -m benchmarks.peers` (optional: skipped without it)

setup(
    name="kfac_optim",
    version="0.1.0",
    description="K-FAC natural-gradient optimizer for PyTorch: a drop-in torch.optim.SGD replacement",
    long_description=Path(__file__).with_name("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    package_dir={"": "src"},
    packages=find_packages("src"),
    python_requires=">=3.10",
    install_requires=["torch>=2.1"],
    extras_require={"examples": EXAMPLES, "dev": DEV, "peers": PEERS},
)
