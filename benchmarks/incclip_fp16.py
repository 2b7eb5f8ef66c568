"""How much float16 autocast without loss scaling loses in IncCLIP's pseudo-text gradient, and
what the loop's loss scale (`cvl.methods.scaling.scaled_grads`) gets back. JSON on stdout.

One SGD step's gradient of Σ_k L_G(k) (Eq. 1) with respect to the K pseudo-text token
embeddings, through a randomly initialised old text tower, three ways: float32 (the
reference), float16 autocast unscaled (cvl before issue 52), float16 autocast at a GradScaler's
scale (2¹⁶, backed off on overflow as the loop's scaler would be): `IncCLIP`'s own
`margin_gradient`, which computes the cosines and margins in float32 in every case. Reported: the relative L2
error of each against float32, the share of the reference's entries in float16's subnormal
range (0 < |g| < 2⁻¹⁴) and the scale used. B memory images (random unit features) and K
mixtures of B captions, as `IncCLIP.before_step` draws them.

    python benchmarks/incclip_fp16.py [--model ViT-B-16] [--pseudo 16] [--images 256]

Float16 autocast on the *CPU* (torch's, which the CPU tests use too); CUDA's kernels round
differently, so a GPU's figures differ (not measured here).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

CAPTIONS = [
    "a red circle on a blue background",
    "small green triangle at the top left",
    "blue square",
    "a star in the corner of the picture",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="ViT-B-16", help="cvl / open_clip model config")
    ap.add_argument("--pseudo", type=int, default=16, help="K pseudo texts")
    ap.add_argument("--images", type=int, default=256, help="B memory images (Eq. 1's mean)")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    import torch
    import torch.nn.functional as F

    import cvl.methods.incclip as incclip
    import cvl.methods.scaling as scaling
    from cvl.methods.incclip import _init_pseudo, pooled_length, token_embedding
    from cvl.models import build_model

    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    t0 = time.time()
    old = build_model("clip", a.model).eval()
    for p in old.parameters():
        p.requires_grad_(False)
    tokens = old.tokenizer([CAPTIONS[k % len(CAPTIONS)] for k in range(a.images)])
    u = F.normalize(torch.randn(a.images, old.embed_dim), dim=-1)
    i, j = torch.randint(a.images, (a.pseudo,)), torch.randint(a.images, (a.pseudo,))
    e_full, struct = _init_pseudo(token_embedding(old), tokens, i, j, torch.rand(a.pseudo))
    n = pooled_length(old, struct) or struct.shape[1]
    e0 = e_full[:, :n].clone()

    def gradient(amp: bool, scaler) -> tuple[torch.Tensor, float]:
        """`margin_gradient` under float16 autocast (`amp`), and the loss scale it used."""
        used = []
        real = scaling.scaled_grads

        def spy(loss_of, grads_of, scaler, agree=False):
            def seen(loss):
                used.append(float(loss.detach()))
                return grads_of(loss)

            return real(loss_of, seen, scaler, agree)

        incclip.scaled_grads = spy
        with torch.autocast("cpu", dtype=torch.float16, enabled=amp):
            g, fwd = incclip.margin_gradient(old, e0, struct[:, :n], u, 0.2, 0.4, scaler)
        incclip.scaled_grads = real
        return g.double(), used[-1] / float(fwd["lg"].detach().sum())

    ref, _ = gradient(False, None)
    out: dict = {}
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    for name, s in (("fp16_unscaled", None), ("fp16_scaled", scaler)):
        g, scale = gradient(True, s)
        out[name] = {
            "relative_error": float((g - ref).norm() / ref.norm()),
            "finite": bool(g.isfinite().all()),
            "scale": round(scale),
        }
    sub = ((ref.abs() < 2.0**-14) & (ref != 0)).double().mean()
    out["reference_subnormal_share"] = float(sub)
    out["setup"] = {"model": a.model, "pseudo_texts": a.pseudo, "images": a.images, "positions": n}
    out["machine"] = {
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "threads": a.threads,
        "load_avg_at_end": os.getloadavg(),
        "seconds": round(time.time() - t0, 1),
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
