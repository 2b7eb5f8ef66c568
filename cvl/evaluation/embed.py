"""Embedding extraction for evaluation and analysis: every image and every caption of a set.

Used by retrieval (all captions of an image count), mAP, zero-shot, linear probe and the
rotation analysis. Distributed-aware: each rank embeds a contiguous part of the set and the
parts are gathered in rank order, so all ranks hold the same full matrices.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm import tqdm

from cvl.data.reader import PairDataset, eval_loader
from cvl.data.transforms import image_transform


@dataclass
class Embeddings:
    """L2-normalised features of an eval set (float32, CPU).

    image_features[i] belongs to sample i; text_features[j] to caption j, whose image is
    text_to_image[j] (several captions per image are all embedded).
    """

    image_features: torch.Tensor
    text_features: torch.Tensor
    text_to_image: torch.Tensor
    captions: list[str]
    ids: list[str]
    categories: list[Any]
    tasks: list[Any]
    extra: dict[str, torch.Tensor] = field(default_factory=dict)

    def __len__(self) -> int:
        return self.image_features.shape[0]


def eval_dataset(model: Any, shards: list, all_captions: bool = True) -> PairDataset:
    """A PairDataset over eval shards with the model's eval transform (no tokenisation).

    Unreadable samples are left out and counted (a warning on stderr names the shards)."""
    ds = PairDataset.from_shards(
        shards, transform=image_transform(model.image_size, train=False)
    ).drop_unreadable()
    if ds.skipped:
        import sys

        print(
            f"warning: {sum(ds.skipped.values())} sample(s) left out of {shards[0]}"
            f"{f' (+{len(shards) - 1} shards)' if len(shards) > 1 else ''}: {dict(ds.skipped)}",
            file=sys.stderr,
        )
    return ds


def _gather_rows(x: torch.Tensor, accelerator: Any, n: int) -> torch.Tensor:
    if accelerator is None or accelerator.num_processes == 1:
        return x
    # Ranks hold contiguous, possibly unequal parts: pad to the same length, gather, trim.
    per = -(-n // accelerator.num_processes)
    pad = torch.zeros((per - x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    g = accelerator.gather(torch.cat([x, pad]).to(accelerator.device)).cpu()
    keep = [
        g[r * per : r * per + min(per, max(0, n - r * per))]
        for r in range(accelerator.num_processes)
    ]
    return torch.cat(keep)


@torch.no_grad()
def embed_dataset(
    model: Any,
    ds: PairDataset,
    batch_size: int = 256,
    accelerator: Any = None,
    progress: bool = False,
    all_captions: bool = True,
    desc: str = "embed",
    texts: bool = True,
    fusion: bool = False,
) -> Embeddings:
    """Embed every image (and every caption, or the first per image) of `ds` with `model`.

    `texts=False` skips the captions (text_features is then empty). `fusion=True` also stores,
    in `extra["fusion"]`, the fusion encoder's [CLS] feature of each (image, first caption)
    pair (L2-normalised; the multi-modal feature CTP uses for mAP): `model.fusion_cls(
    model(images, tokens)["image_embeds"], tokens)`.
    """
    rank = accelerator.process_index if accelerator is not None else 0
    world = accelerator.num_processes if accelerator is not None else 1
    device = accelerator.device if accelerator is not None else next(model.parameters()).device
    was_training = model.training
    model.eval()
    n = len(ds)
    imgs, ids, cats, tasks, caps_per_item, fus = [], [], [], [], [], []
    loader = eval_loader(ds, batch_size, rank=rank, world=world)
    for batch in tqdm(loader, desc=desc, disable=not progress or rank != 0, leave=False):
        images = batch["image"].to(device)
        if fusion:
            tok = model.tokenizer(list(batch["caption"])).to(device)
            out = model(images, tok)
            cls = model.fusion_cls(out["image_embeds"], tok)
            fus.append(torch.nn.functional.normalize(cls.float(), dim=-1).cpu())
            imgs.append(out["image_features"].float().cpu())
        else:
            imgs.append(model.encode_image(images).float().cpu())
        ids.extend(batch["id"])
        cats.extend(batch["category"])
        tasks.extend(batch["task"])
        caps_per_item.extend(batch["captions"] if all_captions else [[c] for c in batch["caption"]])
    local_img = torch.cat(imgs) if imgs else torch.zeros(0, model.embed_dim)
    # Texts: embed this rank's captions, then gather metadata via objects.
    flat = [c for cs in caps_per_item for c in cs] if texts else []
    txts = []
    for s in range(0, len(flat), batch_size):
        tok = model.tokenizer(flat[s : s + batch_size]).to(device)
        txts.append(model.encode_text(tok).float().cpu())
    local_txt = torch.cat(txts) if txts else torch.zeros(0, model.embed_dim)
    if world > 1:
        from accelerate.utils import gather_object

        image_features = _gather_rows(local_img, accelerator, n)
        if fusion:
            local_fus = torch.cat(fus) if fus else torch.zeros(0, 1)
            fus = [_gather_rows_var(local_fus, accelerator)]
        parts = gather_object([(ids, cats, tasks, caps_per_item)])
        ids, cats, tasks, caps_per_item = [], [], [], []
        for p in parts:
            ids += p[0]
            cats += p[1]
            tasks += p[2]
            caps_per_item += p[3]
        counts = [len(c) if texts else 0 for c in caps_per_item]
        text_features = _gather_rows_var(local_txt, accelerator)
        assert text_features.shape[0] == sum(counts)
    else:
        image_features, text_features = local_img, local_txt
        counts = [len(c) if texts else 0 for c in caps_per_item]
    text_to_image = torch.repeat_interleave(
        torch.arange(len(counts)), torch.tensor(counts, dtype=torch.long)
    )
    if was_training:
        model.train()
    return Embeddings(
        image_features=image_features,
        text_features=text_features,
        text_to_image=text_to_image,
        captions=[c for cs in caps_per_item for c in cs] if texts else [],
        ids=list(ids),
        categories=list(cats),
        tasks=list(tasks),
        extra={"fusion": torch.cat(fus)} if fusion and fus else {},
    )


def concat_embeddings(parts: list[Embeddings]) -> Embeddings:
    """One Embeddings of several sets in order (text_to_image offsets shifted; extras kept
    when every part has them)."""
    if len(parts) == 1:
        return parts[0]
    t2i, n = [], 0
    for p in parts:
        t2i.append(p.text_to_image + n)
        n += len(p)
    keys = set.intersection(*(set(p.extra) for p in parts)) if parts else set()
    return Embeddings(
        image_features=torch.cat([p.image_features for p in parts]),
        text_features=torch.cat([p.text_features for p in parts]),
        text_to_image=torch.cat(t2i),
        captions=[c for p in parts for c in p.captions],
        ids=[i for p in parts for i in p.ids],
        categories=[c for p in parts for c in p.categories],
        tasks=[t for p in parts for t in p.tasks],
        extra={k: torch.cat([p.extra[k] for p in parts]) for k in sorted(keys)},
    )


def _gather_rows_var(x: torch.Tensor, accelerator: Any) -> torch.Tensor:
    """Gather tensors of different row counts from all ranks, in rank order."""
    from accelerate.utils import gather_object

    sizes = gather_object([x.shape[0]])
    per = max(sizes)
    pad = torch.zeros((per - x.shape[0], *x.shape[1:]), dtype=x.dtype)
    g = accelerator.gather(torch.cat([x, pad]).to(accelerator.device)).cpu()
    return torch.cat([g[r * per : r * per + s] for r, s in enumerate(sizes)])
