"""Install script for kfac_optim (src layout; the core depends on torch only)."""

from pathlib import Path

from setuptools import find_packages, setup

# torchvision pins the torch release it was built for (``torch==X``), so pip never installs two
# releases that do not match; it cannot check the build (CPU-only or CUDA): a mismatched build fails
# one test, tests/project/test_install.py, which names the fix (README.md, Install).
EXAMPLES = ["torchvision", "scikit-learn", "pyyaml", "tqdm", "matplotlib"]
# The trainers tests/scripts/test_trainers.py runs KFAC under (tested: pytorch-lightning 2.6.6, transformers
# 5.24.0, accelerate 1.15.0); none of them pins torch.
TRAINERS = ["pytorch-lightning>=2.6", "transformers>=5.0", "accelerate>=1.0"]
# The real-library models of benchmarks/zoo (python -m benchmarks.zoo, tests/models/); each library is optional:
# a missing one skips its models.
MODELS = ["timm", "diffusers", "peft"]
DEV = EXAMPLES + TRAINERS + MODELS + ["pytest", "pytest-xdist", "ruff>=0.6"]
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
    extras_require={"examples": EXAMPLES, "trainers": TRAINERS, "models": MODELS, "dev": DEV,
                    "peers": PEERS},
)
