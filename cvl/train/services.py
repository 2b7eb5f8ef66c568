"""What the trainer offers methods and buffers besides the loop (`ctx.services`): a task's
training samples, the previous task's frozen model, one feature per pair for buffer
selection. A mixin of `cvl.train.loop.Trainer` (it uses the trainer's attributes)."""

from __future__ import annotations

from typing import Any

import torch

from cvl.data.index import Entries
from cvl.data.reader import PairDataset, eval_loader
from cvl.data.selection import task_dataset
from cvl.data.transforms import image_transform
from cvl.methods.base import TaskContext, frozen_copy
from cvl.runs import MODEL_FILE, task_dir
from cvl.train.fsdp import gathered


class TrainerServices:
    """`entries_of`, `previous_model`, `pair_features` (module doc)."""

    def entries_of(self, task: str) -> Entries:
        """Training entries of a task (integers over its shards' on-disk indexes)."""
        if task not in self._entries:
            ds = task_dataset(self.manifest, task)
            self._entries[task] = ds.entries
            self.skipped = getattr(self, "skipped", {})
            self.skipped[task] = dict(ds.skipped)
        return self._entries[task]

    def previous_model(self, ctx: TaskContext) -> Any:
        """Frozen copy of the weights saved after task `ctx.task_index - 1`."""
        from cvl.models import load_weights

        i = ctx.task_index - 1
        if self._prev_cache is None or self._prev_cache[0] != i:
            m = frozen_copy(self.model)  # --fsdp: sharded on the model's plan
            load_weights(m, task_dir(self.out, i, self.order[i]) / MODEL_FILE)
            self._prev_cache = (i, m.to(self.acc.device))
        return self._prev_cache[1]

    @torch.no_grad()
    def pair_features(self, entries: Entries, batch_size: int = 256) -> torch.Tensor:
        """One feature per pair for buffer selection: fusion CLS, else normalise(v + w)."""
        model = self.model
        ds = PairDataset(entries, image_transform(model.image_size, train=False), model.tokenizer)
        was = model.training
        model.eval()
        feats = []
        rank, world = self.acc.process_index, self.acc.num_processes
        with gathered(model):  # --fsdp: ranks may embed different numbers of batches
            for b in eval_loader(ds, batch_size, rank=rank, world=world):
                img, txt = b["image"].to(self.acc.device), b["text"].to(self.acc.device)
                out = model(img, txt)
                if getattr(model, "has_fusion", False):
                    f = torch.nn.functional.normalize(
                        model.fusion_cls(out["image_embeds"], txt), dim=-1
                    )
                else:
                    f = torch.nn.functional.normalize(
                        out["image_features"] + out["text_features"], dim=-1
                    )
                feats.append(f.float())
        model.train(was)
        local = torch.cat(feats) if feats else torch.zeros(0, model.embed_dim)
        if world > 1:
            from cvl.evaluation.embed import _gather_rows

            return _gather_rows(local, self.acc, len(ds))
        return local.cpu()
