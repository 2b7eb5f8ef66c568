"""Run several `cvl` commands in one torchrun launch (one interpreter start per rank for all).

    torchrun --nproc_per_node 2 tests/dist_many.py COMMANDS.json RESULTS.json

COMMANDS.json maps a name to an argv list, or to {"argv": [...], "context": "module:name"}:
the command runs inside that context manager (e.g. unused_param_run:unused_param). Rank 0
writes each command's exit code to RESULTS.json (a command that raises is recorded as
'error: ...' and the next one runs).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import sys
import traceback

import torch

from cvl.cli import main

if __name__ == "__main__":
    import accelerate

    torch.set_num_threads(1)
    # end_training() destroys the process group; the next command needs it (no trackers here)
    accelerate.Accelerator.end_training = lambda self: None
    commands = json.loads(open(sys.argv[1]).read())
    results: dict[str, object] = {}
    for name, cmd in commands.items():
        argv, ctx = (cmd["argv"], cmd.get("context")) if isinstance(cmd, dict) else (cmd, None)
        try:
            mod, _, attr = (ctx or "").partition(":")
            with getattr(importlib.import_module(mod), attr)() if ctx else contextlib.nullcontext():
                results[name] = main(argv)
        except Exception as e:  # noqa: BLE001 (report and continue with the next method)
            traceback.print_exc()
            results[name] = f"error: {type(e).__name__}: {e}"
    if int(os.environ.get("RANK", "0")) == 0:
        with open(sys.argv[2], "w") as f:
            json.dump(results, f)
