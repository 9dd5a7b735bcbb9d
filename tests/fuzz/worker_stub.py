"""A stand-in for the fuzz's GPU worker (``tests.fuzz.worker.worker``), for the CPU test of ``run_workers``: it takes seeds
as the real one does and, by seed, reports a case as run, reports a fatal case and exits with status 3 (as the real
one does after a CUDA fault), or dies inside a case without reporting it. Imports the standard library only."""

from __future__ import annotations

import os
import queue
import sys
import time


def outcome(seed: int) -> str:
    return "fatal" if seed % 7 == 3 else "crash" if seed % 11 == 5 else "ok"


def worker(index: int, tasks, results, fresh: bool, deadline: float | None) -> None:
    while deadline is None or time.time() < deadline:
        try:
            seed = tasks.get(timeout=1.0)
        except queue.Empty:
            break
        results.put(("start", index, seed))
        kind = outcome(seed)
        if kind == "crash":
            os._exit(1)
        results.put(("done", index, {"seed": seed, "status": kind, "worker": index}))
        if kind == "fatal":
            sys.exit(3)
