"""The fuzz's GPU worker process: takes seeds from ``tasks``, runs each case on its own ``Runner`` and posts
``("start", index, seed)`` and ``("done", index, result)`` to ``results``. A module of its own (not
``__main__``), so that a spawned process can import it by name."""

from __future__ import annotations

import queue
import sys
import time

from .cases import case


def worker(index: int, tasks, results, fresh: bool, deadline: float | None) -> None:
    import torch

    from .runner import Runner

    torch.cuda.init()
    runner = Runner()
    while deadline is None or time.time() < deadline:
        try:
            seed = tasks.get(timeout=2.0)
        except queue.Empty:
            break
        results.put(("start", index, seed))
        result = runner.run(case(seed, fresh))
        results.put(("done", index, result))
        if result["status"] == "fatal":  # the CUDA context is gone: end, and let a new worker take over
            sys.exit(3)
