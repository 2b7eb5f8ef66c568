"""Linear probe: logistic regression on frozen, L2-normalised image features (scikit-learn).

The inverse regularisation strength C is chosen on a validation split from a small log grid
(`CS`); the classifier is then refit on train + validation with the best C and scored on the
test features (top-1, percent). When no validation set is given, a stratified 20% of the
training features is held out for the search (fixed seed). Items with a missing label are
dropped. L-BFGS, multinomial loss, as in CLIP's linear-probe protocol (which also searches C).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

CS = (0.1, 1.0, 10.0, 100.0, 1000.0)


def _xy(feats: torch.Tensor, labels: Sequence[Any]) -> tuple[np.ndarray, np.ndarray]:
    keep = [i for i, y in enumerate(labels) if y is not None]
    x = torch.nn.functional.normalize(feats.float(), dim=-1)[keep].numpy().astype(np.float64)
    y = np.array([str(labels[i]) for i in keep], dtype=object)
    return x, y


def linear_probe(
    train_features: torch.Tensor,
    train_labels: Sequence[Any],
    test_features: torch.Tensor,
    test_labels: Sequence[Any],
    val_features: torch.Tensor | None = None,
    val_labels: Sequence[Any] | None = None,
    cs: Sequence[float] = CS,
    max_iter: int = 1000,
    seed: int = 0,
) -> dict[str, Any] | None:
    """Probe accuracy (percent) with the C search; None when there are < 2 training classes."""
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import train_test_split

    xtr, ytr = _xy(train_features, train_labels)
    xte, yte = _xy(test_features, test_labels)
    if len(set(ytr)) < 2 or len(yte) == 0:
        return None
    if val_features is not None and val_labels is not None:
        xva, yva = _xy(val_features, val_labels)
        xfit, yfit = xtr, ytr
    else:
        xva = yva = None
    if xva is None or len(yva) == 0:
        counts = {c: int((ytr == c).sum()) for c in set(ytr)}
        strat = ytr if min(counts.values()) >= 2 and len(ytr) * 0.2 >= len(counts) else None
        xfit, xva, yfit, yva = train_test_split(
            xtr, ytr, test_size=0.2, random_state=seed, stratify=strat
        )
        if len(set(yfit)) < 2:
            xfit, yfit = xtr, ytr
    import warnings

    val_acc: dict[str, float] = {}
    best_c, best = cs[0], -1.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        for c in cs:
            clf = LogisticRegression(C=c, max_iter=max_iter, random_state=seed)
            clf.fit(xfit, yfit)
            acc = 100.0 * float((clf.predict(xva) == yva).mean())
            val_acc[str(c)] = acc
            if acc > best:  # first (smallest) C wins ties: the most regularised
                best_c, best = c, acc
        clf = LogisticRegression(C=best_c, max_iter=max_iter, random_state=seed)
        clf.fit(np.concatenate([xfit, xva]), np.concatenate([yfit, yva]))
    top1 = 100.0 * float((clf.predict(xte) == yte).mean())
    return {
        "top1": top1,
        "C": best_c,
        "val_top1": val_acc,
        "n_train": int(len(ytr)),
        "n_test": int(len(yte)),
        "n_classes": int(len(set(ytr))),
    }
