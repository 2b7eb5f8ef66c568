"""img2dataset in a watched child process: `DownloadOptions` (how it fetches), `run_img2dataset`
(the child in its own process group, killed ``exit_grace`` seconds after its last shard is done
or after ``stall_timeout`` seconds without progress) and `child_main`, what the child runs
(``python -m cvl.streams.download CONFIG``).

Kept apart from the download cache (download.py), which decides what to fetch and reads what
came back; this module only runs img2dataset. `cvl.streams.download` re-exports every name.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cvl.errors import CvlError
from cvl.streams.resize import (
    CHILD_ENV,
)

DISTRIBUTORS = ("multiprocessing", "pyspark", "ray")


@dataclass(frozen=True)
class DownloadOptions:
    """How img2dataset fetches (does not change the image bytes; not part of the cache key)."""

    processes: int = 1
    threads: int = 32
    timeout: float = 10.0
    retries: int = 0
    distributor: str = "multiprocessing"
    shard_size: int = 10000
    retry_failed: bool = True
    user_agent_token: str | None = None
    exit_grace: float = 30.0
    stall_timeout: float = 900.0

    def __post_init__(self) -> None:
        if self.distributor not in DISTRIBUTORS:
            raise CvlError(f"--distributor must be one of {', '.join(DISTRIBUTORS)}")
        for name in ("processes", "threads", "shard_size"):
            if getattr(self, name) <= 0:
                raise CvlError(f"--{name.replace('_', '-')} must be positive")
        if self.timeout <= 0:
            raise CvlError("--timeout must be positive")


# -- the watched child process -------------------------------------------------------------------
def done_shards(batch: Path) -> list[str]:
    """Shard names (e.g. '00000') of a batch whose _stats.json exists (img2dataset writes it
    last: only those shards are complete)."""
    return sorted(p.name[: -len("_stats.json")] for p in batch.glob("*_stats.json"))


def _kill_group(proc: subprocess.Popen, grace: float = 5.0) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def _folder_activity(folder: Path) -> tuple[int, int]:
    """(number of files, total bytes) under a folder: changes while img2dataset works."""
    n = size = 0
    if folder.is_dir():
        for root, _, files in os.walk(folder):
            for f in files:
                n += 1
                with contextlib.suppress(OSError):
                    size += os.path.getsize(os.path.join(root, f))
    return n, size


def run_img2dataset(
    config_path: Path,
    batch: Path,
    log_path: Path,
    expected_shards: int,
    opts: DownloadOptions,
    progress: bool = True,
    command: list[str] | None = None,
    poll: float = 0.25,
) -> dict[str, Any]:
    """Run img2dataset on `config_path` in a child process group under the watchdog.

    Returns {"seconds", "returncode", "watchdog"} (watchdog: why the child was killed, if it
    was). Raises CvlError when the child fails before finishing any shard.
    """
    from cvl.progress import progress_bar

    cmd = [*(command or [sys.executable, "-m", "cvl.streams.download"]), str(config_path)]
    env = {**os.environ, **CHILD_ENV}
    t0 = time.monotonic()
    watchdog = None
    with open(log_path, "ab") as logf:
        proc = subprocess.Popen(
            cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        bar = progress_bar(
            total=expected_shards,
            desc="img2dataset",
            unit="shard",
            show=progress,
            leave=False,
        )
        last_activity, last_change = None, time.monotonic()
        all_done_at = None
        try:
            while proc.poll() is None:
                time.sleep(poll)
                done = len(done_shards(batch)) if batch.is_dir() else 0
                if min(done, expected_shards) != bar.n:
                    bar.update(min(done, expected_shards) - bar.n)
                act = (done, *_folder_activity(batch))
                now = time.monotonic()
                if act != last_activity:
                    last_activity, last_change = act, now
                if done >= expected_shards:
                    all_done_at = all_done_at or now
                    if now - all_done_at > opts.exit_grace:
                        watchdog = (
                            f"killed: all {expected_shards} shard(s) done but img2dataset did not "
                            f"exit within {opts.exit_grace:g}s"
                        )
                        break
                elif now - last_change > opts.stall_timeout:
                    watchdog = f"killed: no progress for {opts.stall_timeout:g}s"
                    break
        except BaseException:
            _kill_group(proc)
            raise
        finally:
            bar.close()
        if watchdog:
            _kill_group(proc)  # the child is alive here: its process group is ours
    rc = proc.returncode
    seconds = round(time.monotonic() - t0, 2)
    done = len(done_shards(batch)) if batch.is_dir() else 0
    if not watchdog and rc not in (0, None) and done == 0:
        tail = _tail(log_path)
        raise CvlError(
            f"img2dataset failed (exit {rc}) before finishing a shard; log {log_path}: {tail}"
        )
    return {"seconds": seconds, "returncode": rc, "watchdog": watchdog}


def _tail(path: Path, n: int = 3) -> str:
    try:
        lines = [x for x in path.read_text(errors="replace").splitlines() if x.strip()]
    except OSError:
        return ""
    return " | ".join(lines[-n:])


def _inline_distributor(processes_count, downloader, reader, subjob_size, max_shard_retry):  # noqa: ANN001
    """img2dataset's multiprocessing distributor without the pool, for processes_count == 1."""
    failed = [row for row in reader if not downloader(row)[0]]
    for _ in range(max_shard_retry):
        if not failed:
            break
        failed = [row for row in failed if not downloader(row)[0]]


class _QuietLogger:
    """Stands in for img2dataset's spawned LoggerProcess in one-process runs."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.done_shards: set = set()

    def start(self) -> None:
        pass

    def join(self, timeout: float | None = None) -> None:
        pass

    def terminate(self) -> None:
        pass


def child_main(config_path: str) -> int:
    """Entry point of the img2dataset child process."""
    for k, v in CHILD_ENV.items():
        os.environ.setdefault(k, v)
    cfg = json.loads(Path(config_path).read_text())
    import img2dataset  # noqa: F401  (its __init__ shadows the `main` submodule with a function)

    i2d = sys.modules["img2dataset.main"]

    one = cfg.get("processes_count", 1) == 1
    if (
        one
        and cfg.get("distributor", "multiprocessing") == "multiprocessing"
        and all(hasattr(i2d, a) for a in ("multiprocessing_distributor", "LoggerProcess"))
    ):
        # one process: no spawn pool and no spawned logger (each would import img2dataset,
        # torch included, again); progress comes from the _stats.json files instead
        i2d.multiprocessing_distributor = _inline_distributor
        i2d.LoggerProcess = _QuietLogger
    i2d.download(**cfg)
    return 0
