"""Tokenizers behind one small interface: `tok(list[str]) -> LongTensor[N, context_length]`.

- `HashTokenizer`: a vocabulary-free word tokenizer for tiny test/demo models (words and CJK
  characters hashed into a small id range), so a 1k-row embedding table serves any language
  and nothing is downloaded. Layout: 0 pad, 1 [CLS]/start, 2 [MASK], 3 unknown, hashed words in
  4..V-2, V-1 end. The end id is the largest, so open_clip's argmax pooling finds it.
- `OpenClipTokenizer`: open_clip's own tokenizer for a named architecture (BPE vocab shipped).
- `BertTokenizer`: a HF WordPiece tokenizer from a local folder (the fusion model's).
"""

from __future__ import annotations

import re
import zlib
from typing import Any

import torch

_WORD = re.compile(r"[\u3400-\u9fff\uf900-\ufaff]|[^\W_]+|[^\w\s]", re.UNICODE)


class HashTokenizer:
    """Lower-cased words (and single CJK characters) hashed into `vocab_size` ids."""

    pad_id, cls_id, mask_id, unk_id = 0, 1, 2, 3

    def __init__(self, vocab_size: int = 1024, context_length: int = 32) -> None:
        if vocab_size < 8:
            raise ValueError("vocab_size must be at least 8")
        self.vocab_size = vocab_size
        self.context_length = context_length
        self.sep_id = vocab_size - 1
        self.special_ids = (self.pad_id, self.cls_id, self.sep_id)

    def word_id(self, word: str) -> int:
        return 4 + zlib.crc32(word.encode("utf-8")) % (self.vocab_size - 5)

    def __call__(self, texts: list[str] | str) -> torch.Tensor:
        if isinstance(texts, str):
            texts = [texts]
        out = torch.zeros(len(texts), self.context_length, dtype=torch.long)
        for r, t in enumerate(texts):
            ids = [self.word_id(w) for w in _WORD.findall(t.lower())]
            ids = [self.cls_id, *ids[: self.context_length - 2], self.sep_id]
            out[r, : len(ids)] = torch.tensor(ids)
        return out

    def config(self) -> dict[str, Any]:
        return {
            "type": "hash",
            "vocab_size": self.vocab_size,
            "context_length": self.context_length,
        }


class OpenClipTokenizer:
    """open_clip's tokenizer for an architecture name (works offline for the BPE models)."""

    mask_id = None

    def __init__(self, model_name: str = "ViT-B-32", context_length: int | None = None) -> None:
        import open_clip

        self.model_name = model_name
        self._tok = open_clip.get_tokenizer(model_name, context_length=context_length)
        self.context_length = getattr(self._tok, "context_length", context_length or 77)
        self.vocab_size = getattr(self._tok, "vocab_size", 49408)
        self.pad_id = 0
        self.cls_id = getattr(self._tok, "sot_token_id", None)
        self.sep_id = getattr(self._tok, "eot_token_id", None)
        self.special_ids = tuple(i for i in (0, self.cls_id, self.sep_id) if i is not None)

    def __call__(self, texts: list[str] | str) -> torch.Tensor:
        return self._tok(texts)

    def config(self) -> dict[str, Any]:
        return {
            "type": "openclip",
            "model_name": self.model_name,
            "context_length": self.context_length,
        }


class BertTokenizer:
    """A local HF WordPiece tokenizer (e.g. a `bert-base-chinese` folder), padded to length."""

    def __init__(self, path: str, context_length: int = 30) -> None:
        from transformers import AutoTokenizer

        self.path = path
        self._tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.context_length = context_length
        self.vocab_size = len(self._tok)
        self.pad_id = self._tok.pad_token_id
        self.cls_id = self._tok.cls_token_id
        self.sep_id = self._tok.sep_token_id
        self.mask_id = self._tok.mask_token_id
        self.special_ids = tuple(self._tok.all_special_ids)

    def __call__(self, texts: list[str] | str) -> torch.Tensor:
        enc = self._tok(
            texts,
            padding="max_length",
            truncation=True,
            max_length=self.context_length,
            return_tensors="pt",
        )
        return enc["input_ids"]

    def config(self) -> dict[str, Any]:
        return {"type": "bert", "path": self.path, "context_length": self.context_length}


def build_tokenizer(cfg: dict[str, Any]) -> HashTokenizer | OpenClipTokenizer | BertTokenizer:
    """Tokenizer from its config dict (as stored in a model config / run.json)."""
    kind = cfg.get("type", "hash")
    args = {k: v for k, v in cfg.items() if k != "type"}
    if kind == "hash":
        return HashTokenizer(**args)
    if kind == "openclip":
        return OpenClipTokenizer(**args)
    if kind == "bert":
        return BertTokenizer(**args)
    raise ValueError(f"unknown tokenizer type '{kind}' (hash, openclip, bert)")
