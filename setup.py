import os
import re

from setuptools import find_packages, setup

here = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(here, "deepspeed_fused", "__init__.py")) as f:
    version = re.search(r'__version__ = "([^"]+)"', f.read()).group(1)
with open(os.path.join(here, "requirements.txt")) as f:
    install_requires = [line.strip() for line in f if line.strip() and not line.startswith("#")]
with open(os.path.join(here, "README.md")) as f:
    long_description = f.read()

setup(
    name="deepspeed_fused",
    version=version,
    description="Fused Triton kernels (RMSNorm, linear cross-entropy, MoE reorder) for DeepSpeed training",
    long_description=long_description,
    long_description_content_type="text/markdown",
    packages=find_packages(include=["deepspeed_fused", "deepspeed_fused.*"]),
    # the RMSNorm's C++ node (built on first use, ops/rms_norm/native.py) and the example job's ds_configs
    package_data={"deepspeed_fused.ops": ["csrc/*.cpp"], "deepspeed_fused": ["configs/*.json"]},
    python_requires=">=3.10",
    install_requires=install_requires,
    # pytest-forked 1.7.5 cannot marshal pytest 9.1+ reports (every forked test "EXITED with status 3").
    # numpy<2.4: Triton's interpreter (the CPU kernel tests). accelerate: the Accelerate integration test.
    # pytest-xdist: the GPU tests' command (pytest tests/gpu -n 4 --forked). trl 1.16.0 (with datasets):
    # the TRL head tests and recipes (the protocol they check is that release's).
    extras_require={
        "test": ["pytest>=7,<9.1", "pytest-forked", "pytest-xdist", "numpy<2.4", "tqdm", "accelerate",
                 "trl==1.16.0", "datasets"],
        "bench": ["liger-kernel", "cut-cross-entropy", "matplotlib", "trl"],
    },
    entry_points={"console_scripts": ["deepspeed-fused=deepspeed_fused.__main__:main"]},
    license="Apache-2.0",
    license_files=["LICENSE"],  # the Apache-2.0 text, in the wheel's .dist-info/licenses/
    classifiers=["Programming Language :: Python :: 3", "Operating System :: POSIX :: Linux"],
)
