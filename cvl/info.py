"""`cvl info PATH`: describe a stream folder or a run folder."""

from __future__ import annotations

from pathlib import Path

import click

from cvl.errors import CvlError
from cvl.io import read_json


def describe_stream(path: Path) -> list[str]:
    """Lines describing a stream: source, split rule, tasks with counts, eval sets, drops."""
    from cvl.streams.manifest import BUILD_REPORT, load_manifest

    m = load_manifest(path)
    lines = [
        f"stream {m.name}  (source {m.source}, seed {m.seed}, schema {m.to_json()['schema']}, "
        f"cvl {m.cvl_version})",
        f"split rule: {m.split_rule}",
        f"task order: {' -> '.join(m.task_order)}",
    ]
    sets = list(m.eval_sets)
    header = f"{'task':>14} {'train':>8} " + " ".join(f"{s:>8}" for s in sets)
    lines.append(header)
    for t in m.task_order:
        row = f"{t:>14} {m.tasks[t].train.count:>8} "
        row += " ".join(
            f"{m.eval_sets[s].tasks[t].count if t in m.eval_sets[s].tasks else '-':>8}"
            for s in sets
        )
        if m.tasks[t].description:
            row += f"  {m.tasks[t].description}"
        lines.append(row)
    for b, bm in m.benchmarks.items():
        lines.append(f"benchmark {b}: {bm.shards.count} pairs  {bm.description}")
    for src in m.sources:
        if src.get("stream_sha256"):
            lines.append(
                f"source {src.get('name')}: {src.get('link')} (stream.json sha256 checked)"
            )
        else:  # a collection the stream reads in place (`cvl build-stream shards`)
            at = src.get("url") or src.get("path")
            index = f", index under {src['index']}" if src.get("index") else ""
            lines.append(f"source {src.get('name')}: {src.get('link')} -> {at} (in place{index})")
    inplace = [t for t in m.task_order if m.tasks[t].train.rows]
    if inplace:
        lines.append(
            f"{len(inplace)} task(s) read rows of their source shards in place "
            f"({sum(m.tasks[t].train.count for t in inplace)} training samples)"
        )
    rep = path / BUILD_REPORT
    if rep.is_file():
        r = read_json(rep)
        lines.append(
            f"build report: read {r.get('read', '?')}, kept {r.get('kept_total', '?')}, "
            f"dropped {r.get('dropped_total', 0)} {r.get('dropped') or ''}".rstrip()
        )
    return lines


def describe_run(path: Path) -> list[str]:
    """Lines describing a run: method, model, stream, finished tasks, evaluation present."""
    run = read_json(path / "run.json")
    cfg = run.get("config", run)
    lines = [
        f"run {path.name}: method {cfg.get('method')} {cfg.get('method_args') or ''}".rstrip(),
        f"model {cfg.get('model')} ({cfg.get('model_config')}), stream {run.get('stream', {}).get('name', cfg.get('stream'))}",
    ]
    if cfg.get("buffer"):
        size = cfg.get("buffer_size")
        lines.append(f"buffer {cfg['buffer']} " + (f"size {size}" if size else "(no size limit)"))
    tu = run.get("tuning")
    if tu:  # runs from before --tune have none (every parameter trained)
        args = ", ".join(f"{k} {v}" for k, v in (tu.get("args") or {}).items())
        lines.append(
            f"tune {tu['mode']}{f' ({args})' if args else ''}: {tu['trainable_params']:,} of "
            f"{tu['total_params']:,} parameters train ({100 * tu['trainable_share']:.2f} %)"
        )
    from cvl.runs import finished_tasks

    tasks_dir = path / "tasks"
    done = [c.path.name for c in finished_tasks(path)]  # never a killed writer's temp folder
    order = run.get("stream", {}).get("task_order") or []
    lines.append(f"finished tasks: {len(done)}/{len(order) or '?'}  {' '.join(done)}")
    for d in done:  # data and numeric faults the run survived (task.json)
        tj = tasks_dir / d / "task.json"
        t = read_json(tj) if tj.is_file() else {}
        faults = {k: v for k, v in (t.get("skipped") or {}).items() if v}
        faults.update(
            {k: t[k] for k in ("replaced_samples", "nonfinite_skipped_steps") if t.get(k)}
        )
        if faults:
            lines.append(f"  {d}: " + ", ".join(f"{k} {v}" for k, v in sorted(faults.items())))
        lines += _cost_lines(d, t)
    if done:
        from cvl.train.cost import describe, summarize_run

        total = summarize_run(path)
        if total["tasks"]:
            lines.append(f"cost of the {total['tasks']} task(s): {describe(total)}")
            lines.append(f"  memory: {total['memory_measure']}")
    for ch in run.get("changes") or []:  # config changes made with --force
        fields = ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in ch.get("fields", {}).items())
        lines.append(
            f"changed with --force from task {ch.get('task_index')} ({ch.get('task')}), step "
            f"{ch.get('step')}: {fields or 'stream'}"
        )
    if (path / "last").is_dir():
        try:
            pos = read_json(path / "last" / "position.json")
        except CvlError:  # written last: a checkpoint killed before it has none
            pos = {}
        where = (
            f"task {pos['task_index']} ({pos.get('task')}) stopped at step {pos['step']}: "
            if "step" in pos and "task_index" in pos
            else ""
        )
        lines.append(f"{where}a mid-task checkpoint exists in last/ (rerun `cvl train` to resume)")
    if (path / "eval" / "metrics.json").is_file():
        lines.append(f"evaluated: {path / 'eval' / 'metrics.json'}")
    return lines


def _cost_lines(name: str, t: dict) -> list[str]:
    """A finished task's cost (and budget) from its task.json (cvl.train.cost)."""
    from cvl.train.cost import describe

    out = []
    if t.get("cost"):
        out.append(f"  {name} cost: {describe(t['cost'])}")
    b = t.get("budget")
    if b:
        capped = f" (capped by --epochs: the budget buys {b['steps']})" if b.get("capped") else ""
        how = []
        if b.get("memory_ratio") is not None:
            ref = (b.get("reference") or {}).get("of", "tune")
            how.append(
                f"memory {b['memory_ratio']:.3g} x {'full fine-tuning' if ref == 'full' else 'its own reference'}"
            )
        if b.get("extras_flops") is not None:
            how.append(
                f"extras {b['extras_flops'] / 1e9:.4g} GFLOPs charged per {b['options']['extras']}"
            )
        how_s = f" ({'; '.join(how)})" if how else ""
        out.append(
            f"  {name} budget {b['spec']}: share {b['share']:.4g}, {b['cost_per_step']:.4g} per "
            f"step{how_s} -> {b['steps_trained']} steps{capped}"
        )
    return out


@click.command("info")
@click.argument("path", type=click.Path())
def info(path: str) -> None:
    """Describe a stream folder (tasks, counts, eval sets) or a run folder (progress)."""
    p = Path(path)
    if not p.exists():
        raise CvlError(f"{p}: no such file or folder")
    if (p / "run.json").is_file():
        lines = describe_run(p)
    elif (p / "stream.json").is_file() or p.name.endswith(".json"):
        lines = describe_stream(p)
    else:
        raise CvlError(f"{p}: neither a stream folder (stream.json) nor a run folder (run.json)")
    click.echo("\n".join(lines))
