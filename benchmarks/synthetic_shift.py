"""How much the previous-task model already knows of the next task (stream diagnostics).

For a trained run: the share of in-batch rows (batches of B test pairs of task t+1) that the
model saved after task t retrieves correctly (image->text top-1 = own caption, identical
captions count), next to the same share for the model after task t+1. Distillation methods
that keep only rows the old model gets right (Mod-X, DKR) need this share to be substantial.

    python benchmarks/synthetic_shift.py --run runs/seqft [--batch 64]
"""

from __future__ import annotations

import argparse
import json

import torch


@torch.no_grad()
def row_accuracy(model, ds, batch: int) -> float:
    from cvl.evaluation.embed import embed_dataset

    e = embed_dataset(model, ds, all_captions=False)
    hits, n = 0, 0
    for s in range(0, len(e) - batch + 1, batch):
        v, w = e.image_features[s : s + batch], e.text_features[s : s + batch]
        caps = e.captions[s : s + batch]
        top = (v @ w.t()).argmax(1).tolist()
        hits += sum(caps[j] == caps[i] for i, j in enumerate(top))
        n += batch
    return hits / max(n, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", required=True)
    ap.add_argument("--batch", type=int, default=64)
    args = ap.parse_args()
    from cvl.evaluation.embed import eval_dataset
    from cvl.runs import finished_tasks, load_run, load_task_model
    from cvl.streams.manifest import load_manifest

    run = load_run(args.run)
    m = load_manifest(run["stream"]["path"])
    done = finished_tasks(args.run)
    out = []
    for prev, cur in zip(done, done[1:]):
        model_prev, _ = load_task_model(args.run, prev.index)
        model_cur, _ = load_task_model(args.run, cur.index)
        ds = eval_dataset(model_prev, m.eval_shards("test", cur.name))
        out.append(
            {
                "task": cur.name,
                "old_model_rows_right": round(row_accuracy(model_prev, ds, args.batch), 4),
                "new_model_rows_right": round(row_accuracy(model_cur, ds, args.batch), 4),
            }
        )
    print(json.dumps({"run": args.run, "batch": args.batch, "pairs": out}, indent=2))


if __name__ == "__main__":
    main()
