"""Evaluation: `cvl eval` and the metric functions behind it.

- `options.py`    EvalOptions (what enters the cache key), --workers / --precision options
- `imagestore.py` eval images decoded once per command (uint8, filled from worker batches)
- `embed.py`      features of an eval set (every image and caption; fusion [CLS]): on the
                  device, loader workers, autocast precision, all ranks
- `features.py`   one checkpoint's features: each eval set embedded once, whoever asks
- `retrieval.py`  TR@K / IR@K / Rm / R@mean, multi-caption and identical-text hits, blocks on
                  the device
- `map.py`        multi-modal mAP@N (CTP eq. 11, the CTP code's variant, positives-normalised)
- `zeroshot.py`   prompt-ensembled zero-shot classification (stream sets, image folders)
- `probe.py`      linear probe (scikit-learn logistic regression, C chosen on a val split)
- `continual.py`  average, BWT (IncCLIP / GEM), forgetting, DHA FR, FWT, CTP so-far vs final
- `checkpoint.py` every metric of one checkpoint (a row of each R matrix, benchmarks, CTP sets)
- `assemble.py`   metrics.json from the rows: R matrices, continual and cumulative tables
- `runner.py`     evaluates a run folder's checkpoints (device, cache) -> metrics.json
- `report.py`     summary.md / CSV tables / PNG heatmaps and curves; `--compare` table
- `cli.py`        the `cvl eval` command (`eval_cmd`)

Every metric function takes plain tensors / lists and is tested on hand-made inputs
(tests/test_eval_metrics.py); `checkpoint.py` and `runner.py` only wire them to stream sets
and checkpoints.
"""
