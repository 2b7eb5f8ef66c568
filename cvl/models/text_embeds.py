"""open_clip's text tower run from token embeddings rather than token ids (IncCLIP's pseudo
texts are learned embeddings): the tower's own layers, positional embedding, final norm,
pooling at the end-of-text token and projection, for open_clip's CLIP and its
TextTransformer."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from cvl.errors import CvlError

# -- open_clip text tower from token embeddings ------------------------------------------------


def _text_tower(clip: nn.Module) -> tuple[str, nn.Module]:
    """("clip", clip) for open_clip's CLIP, ("custom", clip.text) for a TextTransformer."""
    from open_clip.transformer import TextTransformer

    if hasattr(clip, "token_embedding") and hasattr(clip, "transformer"):
        return "clip", clip
    text = getattr(clip, "text", None)
    if isinstance(text, TextTransformer):
        return "custom", text
    raise CvlError(
        "incclip needs an open_clip text transformer (token embeddings); "
        "this model's text tower is not one (HF text towers and the fusion model are not supported)"
    )


def token_embedding(model: Any) -> nn.Embedding:
    """The token-embedding table of a `clip` VLModel's text tower."""
    clip = getattr(model, "clip", model)
    _, tower = _text_tower(clip)
    return tower.token_embedding


def pooled_length(model: Any, tokens: torch.Tensor) -> int | None:
    """1 + the last position a causal text tower pools at for `tokens` [N, L], or None.

    With open_clip's causal mask, the pooled (end-token) output depends only on positions up
    to the pooled one: later positions can be left out of the forward without changing any
    feature, and their gradient is exactly zero. None when the tower is not causal, has a CLS
    token, or pools elsewhere (then nothing is trimmed). A data-dependent shape: with `tokens`
    on a GPU one host sync (IncCLIP's step passes the CPU copies of its memory's ids).
    """
    clip = getattr(model, "clip", model)
    kind, t = _text_tower(clip)
    if kind == "clip":
        mask, pool, eos, cls = clip.attn_mask, clip.text_pool_type, clip.text_eos_id, None
    else:
        mask, pool, eos, cls = t.attn_mask, t.pool_type, getattr(t, "eos_id", None), t.cls_emb
    if mask is None or cls is not None:
        return None
    if pool == "argmax":
        idx = tokens.argmax(dim=-1)
    elif pool == "eos" and eos is not None:
        idx = (tokens == eos).int().argmax(dim=-1)
    else:
        return None
    return int(idx.max()) + 1 if idx.numel() else None


def encode_text_embeds(
    model: Any,
    embeds: torch.Tensor,
    tokens: torch.Tensor,
    normalize: bool = True,
    length: int | None = None,
) -> torch.Tensor:
    """open_clip's `encode_text` from token embeddings [N, L, W] instead of token ids.

    `tokens` [N, L] only decide where the tower pools (argmax / eos position) and, for towers
    with a padding mask, which positions are masked; `encode_text_embeds(m,
    token_embedding(m)(t), t)` equals `m.encode_text(t)`. Causal towers run only the first
    `length` positions (default: `pooled_length(model, tokens)`; the features are the same).
    """
    from open_clip.transformer import _expand_token, text_global_pool

    clip = getattr(model, "clip", model)
    kind, t = _text_tower(clip)
    if length is None:
        length = pooled_length(model, tokens)
    if length is not None and length < embeds.shape[1]:
        embeds, tokens = embeds[:, :length], tokens[:, :length]
    n = embeds.shape[1]
    cast = t.transformer.get_cast_dtype()
    x = embeds.to(cast)
    if kind == "clip":
        x = x + clip.positional_embedding[:n].to(cast)
        mask = clip.attn_mask[:n, :n] if clip.attn_mask is not None else None
        x = clip.transformer(x, attn_mask=mask)
        x = clip.ln_final(x)
        x = text_global_pool(x, tokens, clip.text_pool_type, getattr(clip, "text_eos_id", None))
        proj = clip.text_projection
    else:
        seq_len = n
        if t.cls_emb is not None:
            x = torch.cat([x, _expand_token(t.cls_emb, x.size(0))], 1)
            seq_len += 1
        attn_mask = t.attn_mask[:seq_len, :seq_len] if t.attn_mask is not None else None
        if t.use_pad_mask or t.cls_emb is not None:
            add = t._build_additive_mask(tokens, seq_len, x.dtype)
            attn_mask = add if attn_mask is None else attn_mask[None] + add
        x = x + t.positional_embedding[:seq_len].to(cast)
        x = t.transformer(x, attn_mask=attn_mask)
        if t.cls_emb is not None:
            x = t.ln_final(text_global_pool(x, pool_type="last"))
        else:
            x = text_global_pool(t.ln_final(x), tokens, t.pool_type, getattr(t, "eos_id", None))
        proj = t.text_projection
    if proj is not None:
        x = proj(x) if isinstance(proj, nn.Linear) else x @ proj
    return F.normalize(x, dim=-1) if normalize else x


# -- the loss terms ------------------------------------------------------------------------------
