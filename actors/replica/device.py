"""Where a replica computes: the GPU Ray gave it, else the CPU."""

from __future__ import annotations

import torch


def pick_device(gpu_ids=None) -> torch.device:
    """``cuda`` when a CUDA device is available, else ``cpu``. Never raises.

    ``gpu_ids``: the GPUs Ray gave the calling actor (``ray.get_gpu_ids()``); an empty list
    means none, so ``cpu`` even where CUDA is visible (Ray does not hide the GPUs from an
    actor that asked for none, and they belong to the actors that did)."""
    if gpu_ids is not None and not list(gpu_ids):
        return torch.device("cpu")
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
