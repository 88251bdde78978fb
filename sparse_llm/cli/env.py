"""Process environment defaults of the entry points, applied before any HF library is imported.

Offline by default: HF libraries read these variables at import time, so without them a missing local
file turns into network look-ups (and, on machines without network, long time-outs). A user who sets a
variable keeps it, and a run that selects a hub-streamed dataset on the command line (`data=fineweb_edu`)
leaves the hub reachable. W&B is quiet and, without an API key, never tries to go online (see
sparse_llm/telemetry/metrics.py for the mode rules).
"""

from __future__ import annotations

import os

HUB_DATASETS = ("fineweb_edu",)
OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")


def apply_defaults(argv: list[str]) -> None:
    """Set the offline/quiet defaults that `argv` (Hydra overrides) and the user's environment leave open."""
    wants_hub = any(arg == f"data={name}" for arg in argv for name in HUB_DATASETS)
    for name in OFFLINE_VARIABLES:
        os.environ.setdefault(name, "0" if wants_hub else "1")
    os.environ.setdefault("WANDB_SILENT", "true")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
