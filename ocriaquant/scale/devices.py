"""`--gpus all|N` (with `--device cuda|cpu`) -> one device per engine worker."""

from __future__ import annotations

import os

from ..errors import OcriaError


def visible_gpus() -> list[str]:
    """The CUDA devices this process sees, as CUDA_VISIBLE_DEVICES entries (ids or UUIDs)."""
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [d.strip() for d in env.split(",") if d.strip()] if env else [str(i) for i in range(n)]
    return ids[:n]


def worker_devices(gpus: str | int, device: str = "cuda") -> list[tuple[str, str | None]]:
    """(device, CUDA_VISIBLE_DEVICES for that worker) per engine worker. `device` cuda: one worker
    per GPU, each seeing only its own (as cuda:0); cpu: N CPU engine workers (tests, dry runs)."""
    text = str(gpus).strip().lower()
    if text != "all" and (not text.isdigit() or int(text) < 1):
        raise OcriaError(f"--gpus takes `all` or a number of GPUs >= 1, got {gpus!r}")
    kind = str(device).split(":")[0]
    if kind == "cpu":
        if text == "all":
            raise OcriaError("--gpus all counts CUDA devices; with --device cpu give the number of CPU engine "
                             "workers, e.g. --gpus 2 --device cpu")
        return [("cpu", None)] * int(text)
    if kind != "cuda":
        raise OcriaError(f"--gpus runs engines on cuda (one per GPU) or cpu; got --device {device}")
    if ":" in str(device):
        raise OcriaError(f"--gpus picks the GPUs itself; give --device cuda, not {device} (CUDA_VISIBLE_DEVICES "
                         "chooses which GPUs it may use)")
    ids = visible_gpus()
    want = len(ids) if text == "all" else int(text)
    if not ids:
        raise OcriaError(f"--gpus {gpus}: no CUDA device is visible here (torch sees none; CUDA_VISIBLE_DEVICES="
                         f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}). Run on a GPU machine, or run CPU "
                         "engine workers with --device cpu --gpus N")
    if want > len(ids):
        raise OcriaError(f"--gpus {want}: only {len(ids)} CUDA device(s) visible here ({', '.join(ids)}); "
                         f"pass --gpus {len(ids)} or --gpus all")
    return [("cuda", i) for i in ids[:want]]
