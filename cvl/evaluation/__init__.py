"""Evaluation: `cvl eval` and the metric functions behind it.

- `embed.py`      features of an eval set (every image and caption; fusion [CLS]), all ranks
- `retrieval.py`  TR@K / IR@K / Rm / R@mean, multi-caption and identical-text hits, chunked
- `map.py`        multi-modal mAP@N (CTP eq. 11, the CTP code's variant, positives-normalised)
- `zeroshot.py`   prompt-ensembled zero-shot classification (stream sets, image folders)
- `probe.py`      linear probe (scikit-learn logistic regression, C chosen on a val split)
- `continual.py`  average, BWT (IncCLIP / GEM), forgetting, DHA FR, FWT, CTP so-far vs final
- `runner.py`     evaluates a run folder's checkpoints (cached) -> R matrices -> metrics.json
- `report.py`     summary.md / CSV tables / PNG heatmaps and curves; `--compare` table
- `cli.py`        the `cvl eval` command (`eval_cmd`)

Every metric function takes plain tensors / lists and is tested on hand-made inputs
(tests/test_eval_metrics.py); `runner.py` only wires them to stream sets and checkpoints.
"""
