"""Run a tinker-cookbook recipe module as ``python -m MODULE ARGS...`` would, with
the hub datasets it loads by name replaced by local JSON files (offline).

Run by the cookbook's own interpreter (``tests/cookbook_env.py``), never by
treadle's: it imports only the cookbook's environment. ``COOKBOOK_LOCAL_DATASETS``
maps a dataset name to a JSON file holding the rows of its ``train`` split.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
from typing import Any

import datasets

LOCAL: dict[str, str] = json.loads(os.environ["COOKBOOK_LOCAL_DATASETS"])
_hub_load = datasets.load_dataset


def load_dataset(path: str, *args: Any, **kwargs: Any) -> Any:
    if path in LOCAL:
        with open(LOCAL[path]) as f:
            rows = json.load(f)
        return datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)})
    return _hub_load(path, *args, **kwargs)


datasets.load_dataset = load_dataset

if __name__ == "__main__":
    module = sys.argv[1]
    sys.argv = [module, *sys.argv[2:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
