"""`cvl ARGV` in a fresh interpreter that stops inside a cached-accumulation step: at the
first-pass forward number CVL_TEST_PAUSE_AT (1-based, counted over the run) it writes the
file CVL_TEST_PAUSE_FILE and sleeps, so a test can SIGKILL it mid-step (tests/test_accum.py).

    python tests/accum_kill_run.py train ...
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from cvl.cli import main
from cvl.train.accum import FeatureCache

if __name__ == "__main__":
    at, marker = int(os.environ["CVL_TEST_PAUSE_AT"]), Path(os.environ["CVL_TEST_PAUSE_FILE"])
    real, calls = FeatureCache.forward, [0]

    def forward(self, batch, run):
        real(self, batch, run)
        calls[0] += 1
        if calls[0] == at:  # this micro-batch's first pass is done, the step's are not
            marker.write_text(str(at))
            time.sleep(600)

    FeatureCache.forward = forward
    sys.exit(main(sys.argv[1:]))
