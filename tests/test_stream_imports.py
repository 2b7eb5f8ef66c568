"""`cvl build-stream compose` (every recipe's smoke composes its sources) writes no shard of its
own, so it starts without torch: webdataset, which imports it, loads only to write shards."""

from __future__ import annotations

import json
import subprocess
import sys


def test_compose_does_not_import_torch(synth_stream, tmp_path):
    task = json.loads((synth_stream / "stream.json").read_text())["task_order"][0]
    out = tmp_path / "one"
    code = (
        "import sys; from cvl.cli import main; "
        f"rc = main(['build-stream', 'compose', '--task', 'a={synth_stream}:task={task}', "
        f"'--out', {str(out)!r}]); print('TORCH' if 'torch' in sys.modules else 'NO-TORCH', rc)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout.split()[-2:] == ["NO-TORCH", "0"], r.stdout[-500:] + r.stderr[-2000:]
    assert json.loads((out / "stream.json").read_text())["task_order"] == ["a"]
