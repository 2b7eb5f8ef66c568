"""`cvl export`: a CLIP run's task checkpoint in open_clip's `local-dir:` format.

    cvl export --run runs/a [--task 02] --out exported/a-t2
    python -c "import open_clip; m = open_clip.create_model('local-dir:exported/a-t2')"

The folder holds `open_clip_config.json` ({"model_cfg", "preprocess_cfg"} as open_clip's
factory reads them, plus a "cvl" block naming the tokenizer and the source run) and
`open_clip_model.safetensors` (the open_clip module's state_dict, open_clip key names), and
a README.md. Models trained with open_clip's own tokenizer load with
`open_clip.get_tokenizer('local-dir:DIR')`; the tiny hash-tokenizer models need
`cvl.data.tokenizers.HashTokenizer` with the recorded settings instead.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from cvl.errors import CvlError

CONFIG_NAME = "open_clip_config.json"
WEIGHTS_NAME = "open_clip_model.safetensors"


def _tokenizer_note(tok: dict[str, Any]) -> str:
    kind = tok.get("type")
    if kind == "openclip":
        return "open_clip's own tokenizer: open_clip.get_tokenizer('local-dir:DIR') gives it."
    if kind == "hash":
        return (
            "NOT an open_clip tokenizer: token ids come from cvl's HashTokenizer "
            f"(cvl.data.tokenizers.HashTokenizer(vocab_size={tok.get('vocab_size')}, "
            f"context_length={tok.get('context_length')})); open_clip.get_tokenizer('local-dir:DIR') "
            "would return its BPE tokenizer, whose ids do not fit this model."
        )
    return f"cvl tokenizer {json.dumps(tok)} (see cvl.data.tokenizers.build_tokenizer)."


def export_run(
    run: str | Path, out: str | Path, task: str | None = None, overwrite: bool = False
) -> Path:
    """Write the run's task checkpoint (default: last finished task) to `out`; returns `out`."""
    from safetensors.torch import save_file

    from cvl.io import atomic_dir, write_json
    from cvl.runs import find_task, load_run, load_task_model

    d = load_run(run)
    kind = (d.get("model") or {}).get("kind")
    if kind != "clip":
        raise CvlError(f"{run}: export supports clip runs (this run's model is '{kind}')")
    find_task(run, task)  # clear error before any work
    model, ck = load_task_model(run, task)
    oc = model.open_clip_config()
    tok = model.config()["tokenizer"]
    oc["cvl"] = {
        "tokenizer": tok,
        "tokenizer_note": _tokenizer_note(tok),
        "run": str(Path(run).resolve()),
        "task": {"index": ck.index, "name": ck.name},
        "model": model.config(),
    }
    state = {k: v.detach().cpu().contiguous().clone() for k, v in model.clip.state_dict().items()}
    with atomic_dir(out, overwrite=overwrite, kind="export", inputs=[run]) as tmp:
        write_json(tmp / CONFIG_NAME, oc)
        save_file(state, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        hf_tok = getattr(getattr(model.tokenizer, "_tok", None), "tokenizer", None)
        if "hf_tokenizer_name" in oc["model_cfg"].get("text_cfg", {}) and hasattr(
            hf_tok, "save_pretrained"
        ):
            hf_tok.save_pretrained(str(tmp))  # open_clip reads an HF tokenizer from local-dir
        (tmp / "README.md").write_text(
            f"# open_clip export of {Path(run).name}, task {ck.index:02d}-{ck.name}\n\n"
            "```python\nimport open_clip\n"
            "model, _, preprocess = open_clip.create_model_and_transforms('local-dir:THIS_DIR')\n"
            "```\n\n"
            f"Tokenizer: {_tokenizer_note(tok)}\n\n"
            f"Image size {model.image_size} px, embedding dim {model.embed_dim}, "
            f"context length {model.context_length}. Exported by `cvl export`.\n",
            encoding="utf-8",
        )
    return Path(out)


@click.command("export")
@click.option("--run", "run", required=True, type=click.Path(file_okay=False), help="Run folder.")
@click.option("--task", default=None, help="Task name or index (default: the last finished task).")
@click.option(
    "--out", required=True, type=click.Path(), help="Output folder (open_clip local-dir)."
)
@click.option("--overwrite", is_flag=True, help="Replace an existing output folder.")
def export(run: str, task: str | None, out: str, overwrite: bool) -> None:
    """Export a CLIP run's checkpoint for open_clip (`create_model('local-dir:OUT')`)."""
    path = export_run(run, out, task=task, overwrite=overwrite)
    click.echo(f"wrote {path} (load with open_clip.create_model('local-dir:{path}'))")
