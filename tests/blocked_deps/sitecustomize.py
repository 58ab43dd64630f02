"""Makes the export's service dependencies unimportable in every Python process started with this folder
first on PYTHONPATH (the compile workers and ranks those processes spawn too): as if not installed.

The device check, and Kiln's compile, load and compare path under it, must run on a GPU host that has
torch, transformers, safetensors and psutil only (docs/gpu.md).
"""

import sys

BLOCKED = ("prefect", "prefect_aws", "prefect_dask", "boto3", "botocore", "dask", "distributed", "cryptography")

for _name in BLOCKED:
    sys.modules[_name] = None  # `import NAME` raises ModuleNotFoundError; importlib.util.find_spec says None
