"""Pages over a Ray cluster with Ray Data: the pages are a dataset, Ray tasks read, render and
encode them (any path fsspec reads, on whichever node runs the task), one engine actor per GPU
decodes them (ActorPoolStrategy), and the results stream back to the driver as they finish.
Ray retries what a lost node or actor held. Ray is optional: `pip install ocriaquant[scale]`."""

from __future__ import annotations

import math
import pickle
from functools import lru_cache
from typing import Iterator

from ..errors import OcriaError

INSTALL = "pip install 'ocriaquant[scale]'  (or: pip install 'ray[data]>=2.40')"


def require_ray():
    try:
        import ray
        import ray.data  # noqa: F401 - the Data library is a separate extra of ray
    except ImportError as e:
        raise OcriaError(f"--ray needs Ray Data, which is not installed ({e}); install it with:\n    {INSTALL}") from None
    return ray


@lru_cache(maxsize=2)
def _encoder(model_dir: str):
    """One processor per Ray worker process, kept across the tasks it runs."""
    import torch

    from ..model.processor import PageEncoder

    return PageEncoder(model_dir, torch.bfloat16)()  # the runtime's dtype, as parse's readers


def _read_row(row: dict, model_dir: str, dpi: int) -> dict:
    """A dataset row (one PageRef) -> the page encoded (pickled arrays) or the reason it failed."""
    from ..data.listing import PageRef, PageReader
    from ..data.stream import pack, read_encode

    ref = PageRef(row["path"], row["name"], None if row["pdf_page"] < 0 else int(row["pdf_page"]), row["prompt"])
    item = read_encode(PageReader(dpi), _encoder(model_dir), ref)
    enc = pickle.dumps(pack(item.enc)) if item.enc is not None else b""
    return {"name": ref.name, "path": ref.path, "enc": enc, "error": item.error or ""}


def connect(address: str, device: str, gpus) -> tuple[int, bool]:
    """Join (or, for "local", start) a Ray cluster; (engine actors to run, whether we started Ray).
    One actor per GPU of the cluster, or `gpus` of them; on the CPU, `gpus` CPU actors (default 1)."""
    ray = require_ray()
    cpu = device.split(":")[0] == "cpu"
    want = None if gpus in (None, "all") else int(gpus)
    if cpu and gpus == "all":
        raise OcriaError("--gpus all counts GPUs; with --device cpu give the number of CPU engine actors, e.g. --gpus 2")
    started = not ray.is_initialized()
    if started:
        local = address == "local"
        try:
            # Locally with CPU actors: a CPU each plus one for reading, whatever the cores (Ray starts
            # a worker process per CPU it is given). With GPUs, Ray counts the machine's own.
            ray.init(address=None if local else address, include_dashboard=False, log_to_driver=False,
                     num_cpus=(want or 1) + 1 if local and cpu else None)
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise OcriaError(f"--ray {address}: cannot reach a Ray cluster ({type(e).__name__}: {e}); start one with "
                             "`ray start --head` (then --ray auto), give its address (--ray ray://HEAD:10001), or "
                             "start Ray here with --ray local") from None
    if cpu:
        return want or 1, started
    have = int(ray.cluster_resources().get("GPU", 0))
    if have == 0:
        raise OcriaError(f"the Ray cluster ({address}) has no GPUs; start its nodes on GPU machines, or run CPU "
                         "engine actors with --device cpu --gpus N")
    if want is not None and want > have:
        raise OcriaError(f"--gpus {want}: the Ray cluster ({address}) has {have} GPU(s); pass --gpus {have} or "
                         "--gpus all")
    return want or have, started


def parse_on_ray(refs: list, job, actor_cls) -> Iterator[dict]:
    """Rows {name, path, error, text, tokens} for every PageRef, as the actors finish them.
    `actor_cls(job, device)` decodes a batch {name, path, error, enc}."""
    ray = require_ray()
    o = job.options
    if not refs:
        return
    actors, started = connect(o.ray, o.device, o.gpus)
    try:
        from ray.data import ActorPoolStrategy, DataContext

        DataContext.get_current().enable_progress_bars = False
        cpu = o.device.split(":")[0] == "cpu"
        rows = [{"path": r.path, "name": r.name, "pdf_page": -1 if r.pdf_page is None else r.pdf_page,
                 "prompt": r.prompt} for r in refs]
        # Blocks of a few pages: reading streams, and every actor gets work early.
        blocks = min(len(rows), max(4 * actors, math.ceil(len(rows) / 16)))
        ds = ray.data.from_items(rows, override_num_blocks=blocks)
        ds = ds.map(_read_row, fn_kwargs={"model_dir": str(job.model_dir), "dpi": o.dpi}, num_cpus=1)
        ds = ds.map_batches(actor_cls, fn_constructor_kwargs={"job": job, "device": "cpu" if cpu else "cuda"},
                            batch_size=o.max_batch, compute=ActorPoolStrategy(size=actors),
                            **({"num_cpus": 1} if cpu else {"num_gpus": 1}))
        yield from ds.select_columns(["name", "path", "error", "text", "tokens"]).iter_rows()
    finally:
        if started:
            ray.shutdown()
