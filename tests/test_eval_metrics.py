"""Evaluation metrics on hand-made inputs: retrieval, mAP@N, zero-shot, probe, continual."""

from __future__ import annotations

import json
import math

import pytest
import torch

from cvl.evaluation import continual as C
from cvl.evaluation.map import ap_variants, fuse_dual, map_at_n
from cvl.evaluation.probe import linear_probe
from cvl.evaluation.retrieval import (
    pair_positives,
    retrieval_metrics,
    retrieval_ranks,
    text_match_positives,
)
from cvl.evaluation.zeroshot import topk_accuracy, zeroshot_classify


class FakeModel(torch.nn.Module):
    """Two-dimensional 'red' vs 'blue' embeddings: images by colour, texts by the word."""

    kind, has_fusion, embed_dim, image_size = "fake", False, 2, 16

    def __init__(self) -> None:
        super().__init__()
        from cvl.data.tokenizers import HashTokenizer

        self.tokenizer = HashTokenizer(256, 16)
        self.ids = torch.tensor([self.tokenizer.word_id("red"), self.tokenizer.word_id("blue")])
        self.dummy = torch.nn.Parameter(torch.zeros(1))

    def encode_image(self, x: torch.Tensor, normalize: bool = True) -> torch.Tensor:
        f = torch.stack([x[:, 0].mean((1, 2)), x[:, 2].mean((1, 2))], 1) + 3.0
        return torch.nn.functional.normalize(f, dim=-1)

    def encode_text(self, tok: torch.Tensor, normalize: bool = True) -> torch.Tensor:
        f = (tok[:, :, None] == self.ids[None, None, :]).float().sum(1) + 0.01
        return torch.nn.functional.normalize(f, dim=-1)


@pytest.fixture
def fake_model():
    return FakeModel()


def feats_for(S: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Image/text features whose dot products are exactly the similarity matrix S [n_img, n_txt]."""
    s = torch.tensor(S, dtype=torch.float32)
    return torch.eye(s.shape[0]), s.t().contiguous()


# -- retrieval ---------------------------------------------------------------------------------
def test_recall_multi_caption_by_hand():
    # 2 images x 2 captions each: captions 0,1 -> image 0; captions 2,3 -> image 1.
    S = [[0.1, 0.9, 0.5, 0.3], [0.8, 0.2, 0.4, 0.7]]
    img, txt = feats_for(S)
    t2i = torch.tensor([0, 0, 1, 1])
    r_img, r_txt = retrieval_ranks(img, txt, pair_positives(t2i, 2))
    # image 0: its best caption (0.9) is first; image 1: best own caption 0.7 < caption 0 (0.8).
    assert r_img.tolist() == [0, 1]
    # caption j ranks the two images by column j.
    assert r_txt.tolist() == [1, 0, 1, 0]
    m = retrieval_metrics(img, txt, t2i)
    assert m["TR@1"] == 50 and m["TR@5"] == 100 and m["IR@1"] == 50 and m["IR@10"] == 100
    assert m["TR@mean"] == pytest.approx(250 / 3) and m["IR@mean"] == pytest.approx(250 / 3)
    six = [m[k] for k in ("TR@1", "TR@5", "TR@10", "IR@1", "IR@5", "IR@10")]
    assert m["Rm"] == pytest.approx(sum(six) / 6)


def test_ties_pessimistic_and_optimistic():
    # A collapsed model: every score equal. Pessimistic -> no hit at 1; optimistic -> all hits.
    n = 4
    img, txt = torch.ones(n, 3) / math.sqrt(3), torch.ones(n, 3) / math.sqrt(3)
    t2i = torch.arange(n)
    pess = retrieval_metrics(img, txt, t2i)
    opt = retrieval_metrics(img, txt, t2i, ties="optimistic")
    assert pess["TR@1"] == 0 and pess["IR@1"] == 0 and pess["TR@5"] == 100  # 3 negatives tie
    assert opt["TR@1"] == 100 and opt["IR@1"] == 100
    # One tie only: image 0's caption ties with one negative -> rank 1 (pess) / 0 (opt).
    img, txt = feats_for([[0.5, 0.5, 0.1], [0.0, 0.9, 0.2], [0.1, 0.0, 0.3]])
    r_p, _ = retrieval_ranks(img, txt, pair_positives(torch.arange(3), 3))
    r_o, _ = retrieval_ranks(img, txt, pair_positives(torch.arange(3), 3), ties="optimistic")
    assert r_p.tolist() == [1, 0, 0] and r_o.tolist() == [0, 0, 0]


def test_text_match_rule_for_repeated_captions():
    caps = ["a red circle", "a blue square", "a red circle"]
    # Image 0 prefers caption 2, which has the same text as its own caption 0.
    img, txt = feats_for([[0.5, 0.1, 0.9], [0.1, 0.8, 0.2], [0.2, 0.1, 0.7]])
    t2i = torch.arange(3)
    pair = retrieval_metrics(img, txt, t2i, caps, match="pair")
    text = retrieval_metrics(img, txt, t2i, caps, match="text")
    assert pair["TR@1"] == pytest.approx(200 / 3)  # image 0 misses at 1
    assert text["TR@1"] == 100
    pos = text_match_positives(t2i, caps, 3)
    assert sorted(zip(pos.image.tolist(), pos.text.tolist())) == [
        (0, 0),
        (0, 2),
        (1, 1),
        (2, 0),
        (2, 2),
    ]
    # IR: caption 0 ("a red circle") ranks image 2 (0.2) below image 0 (0.5): a hit either way;
    # caption 2 prefers image 0 (0.9) over its own image 2 (0.7): a hit only by text.
    assert pair["IR@1"] == pytest.approx(200 / 3) and text["IR@1"] == 100


def _brute_ranks(S: torch.Tensor, t2i: torch.Tensor, pessimistic: bool = True):
    n_i, n_t = S.shape
    pos = torch.zeros(n_i, n_t, dtype=torch.bool)
    pos[t2i, torch.arange(n_t)] = True
    out_i, out_t = [], []
    for i in range(n_i):
        best = S[i][pos[i]].max()
        neg = S[i][~pos[i]]
        out_i.append(int((neg >= best).sum() if pessimistic else (neg > best).sum()))
    for j in range(n_t):
        best = S[:, j][pos[:, j]].max()
        neg = S[:, j][~pos[:, j]]
        out_t.append(int((neg >= best).sum() if pessimistic else (neg > best).sum()))
    return out_i, out_t


@pytest.mark.parametrize("pessimistic", [True, False])
def test_chunked_ranks_match_brute_force(pessimistic):
    g = torch.Generator().manual_seed(0)
    n_i = 37
    t2i = torch.randint(0, n_i, (90,), generator=g)
    t2i[:n_i] = torch.arange(n_i)  # every image has at least one caption
    # Quantised scores: plenty of exact ties.
    S = (torch.randint(0, 6, (n_i, 90), generator=g).float()) / 5
    img, txt = torch.eye(n_i), S.t().contiguous()
    ties = "pessimistic" if pessimistic else "optimistic"
    for block in (7, 90 * 5, 1 << 20):  # several rows per block, and one block
        ri, rt = retrieval_ranks(img, txt, pair_positives(t2i, n_i), ties=ties, block_elems=block)
        bi, bt = _brute_ranks(S, t2i, pessimistic)
        assert ri.tolist() == bi and rt.tolist() == bt


# -- mAP@N ------------------------------------------------------------------------------------
def test_ap_variants_by_hand():
    hits = [True, False, True, False, False, True]
    ap = {n: ap_variants(hits, n, n_pos=3) for n in (1, 5, 10)}
    assert ap[1] == {"eq11": 1.0, "pos": 1.0, "code": 1.0}
    assert ap[5]["eq11"] == pytest.approx((1 + 2 / 3) / 2)
    assert ap[5]["pos"] == pytest.approx((1 + 2 / 3) / 3)
    assert ap[5]["code"] == pytest.approx((1 + 2 / 3) / 2)  # window min(5, 3) = 3
    assert ap[10]["eq11"] == pytest.approx((1 + 2 / 3 + 3 / 6) / 3)
    assert ap[10]["code"] == pytest.approx((1 + 2 / 3) / 2)  # the CTP code stops at 3 items
    assert ap_variants([False, False], 5, n_pos=1) == {"eq11": 0.0, "pos": 0.0, "code": 0.0}


def test_map_at_n_by_hand_with_self_exclusion():
    # One query "q" (label a); gallery: the query's own item first, then 6 items.
    labels = ["a", "a", "b", "a", "b", "b", "a"]
    ids = ["q", "g0", "g1", "g2", "g3", "g4", "g5"]
    scores = [1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4]
    q, g = feats_for([scores])
    m = map_at_n(q, g, ["a"], labels, ["q"], ids)
    assert m["mAP@1"] == pytest.approx(100.0)
    assert m["mAP@5"] == pytest.approx(100 * (1 + 2 / 3) / 2)
    assert m["mAP@10"] == pytest.approx(100 * (1 + 2 / 3 + 3 / 6) / 3)
    # The code's window: min(N, 4 items of label a incl. the query, 6 candidates) = 4 at N=5, 10.
    assert m["mAP@10/code"] == pytest.approx(100 * (1 + 2 / 3) / 2)
    assert m["mAP@10/pos"] == pytest.approx(100 * (1 + 2 / 3 + 3 / 6) / 3)  # 3 positives
    assert m["mAP@5/pos"] == pytest.approx(100 * (1 + 2 / 3) / 3)
    assert m["n_queries"] == 1 and m["n_no_positive"] == 0


def test_map_code_variant_loses_a_slot_when_the_query_is_retrieved():
    # 12 gallery items, query's own item ranked 1st: the code scans only 9 of the top 10.
    n = 12
    labels = ["a"] + ["b"] * 9 + ["a", "a"]  # own item, 9 negatives, then 2 positives
    ids = ["q"] + [f"g{i}" for i in range(1, n)]
    q, g = feats_for([[1.0 - 0.01 * i for i in range(n)]])
    m = map_at_n(q, g, ["a"], labels, ["q"], ids)
    assert m["mAP@10"] == pytest.approx(100 * (1 / 10))  # positive at rank 10 after exclusion
    assert m["mAP@10/code"] == 0.0  # the code's list ends at rank 9


def test_map_ties_and_no_positive():
    # Query 0: a negative and a positive tie at the top -> the positive ranks 2nd (pessimistic).
    q = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    g = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    m = map_at_n(q, g, ["a", "c"], ["b", "a", "b"], ns=(1, 5))
    assert m["mAP@1"] == pytest.approx(0.0)  # query 1 (label c) has no positive: AP 0
    assert m["mAP@5"] == pytest.approx(100 * (0.5 + 0) / 2)
    assert m["n_no_positive"] == 1


def test_map_blocks_agree():
    g_ = torch.Generator().manual_seed(1)
    q = torch.nn.functional.normalize(torch.randn(23, 8, generator=g_), dim=-1)
    g = torch.nn.functional.normalize(torch.randn(41, 8, generator=g_), dim=-1)
    ql = torch.randint(0, 3, (23,), generator=g_).tolist()
    gl = torch.randint(0, 3, (41,), generator=g_).tolist()
    a = map_at_n(q, g, ql, gl, block_elems=41 * 2)
    b = map_at_n(q, g, ql, gl, block_elems=1 << 20)
    assert a == b


def test_fuse_dual_is_unit_norm():
    f = fuse_dual(torch.randn(5, 4), torch.randn(5, 4))
    assert torch.allclose(f.norm(dim=-1), torch.ones(5))


# -- zero-shot and probe ---------------------------------------------------------------------
def test_zeroshot_separable_toy():
    classes = ["circle", "square", "star"]
    cf = torch.eye(3)
    img = torch.eye(3)[[0, 1, 2, 2, 1, 0]] + 0.1 * torch.randn(
        6, 3, generator=torch.Generator().manual_seed(0)
    )
    z = zeroshot_classify(img, ["circle", "square", "star", "star", "square", None], cf, classes)
    assert z["top1"] == 100 and z["n"] == 5 and z["n_skipped"] == 1
    assert z["top5"] is None  # 3 classes: top-5 would be trivially 100


def test_topk_ties_pessimistic():
    s = torch.ones(4, 6)
    r = topk_accuracy(s, torch.tensor([0, 1, 2, 3]), (1, 5))
    assert r["top1"] == 0 and r["top5"] == 0  # 5 other classes tie with the true one
    s[:, 0] = 2.0
    r = topk_accuracy(s, torch.tensor([0, 0, 1, 1]), (1, 5))
    assert r["top1"] == 50 and r["top5"] == 50


def test_prompt_ensembling_with_a_fake_model(fake_model):
    from cvl.evaluation.zeroshot import class_embeddings, load_templates

    t = load_templates("synthetic")
    cf = class_embeddings(fake_model, ["red", "blue"], t)
    assert cf.shape == (2, 2) and torch.allclose(cf.norm(dim=-1), torch.ones(2))
    assert cf[0, 0] > cf[0, 1] and cf[1, 1] > cf[1, 0]


def test_linear_probe_blobs():
    g = torch.Generator().manual_seed(0)
    centers = torch.tensor([[3.0, 0, 0], [0, 3.0, 0], [0, 0, 3.0]])

    def blob(n):
        y = torch.arange(n) % 3
        return centers[y] + 0.3 * torch.randn(n, 3, generator=g), [f"c{i}" for i in y.tolist()]

    xtr, ytr = blob(60)
    xva, yva = blob(15)
    xte, yte = blob(30)
    r = linear_probe(xtr, ytr, xte, yte, xva, yva)
    assert r["top1"] == 100 and r["n_classes"] == 3 and r["C"] in (0.1, 1.0, 10.0, 100.0, 1000.0)
    r2 = linear_probe(xtr, ytr, xte, yte)  # validation split carved out of train
    assert r2["top1"] == 100
    assert linear_probe(xtr, ["x"] * 60, xte, yte) is None


# -- continual metrics on a hand-made R matrix ------------------------------------------------
R = [[80.0, 10.0, 5.0], [85.0, 70.0, 12.0], [50.0, 55.0, 90.0]]
ZS = [10.0, 5.0, 3.0]


def test_average_final_and_seen():
    assert C.average_final(R) == pytest.approx(65.0)
    assert C.average_seen(R) == pytest.approx([80.0, 77.5, 65.0])


def test_bwt_incclip():
    # 1/(N-1) sum_{i=2..3} 1/i sum_{j<=i} (A_j^i - A_j^j): i=2: (85-80+0)/2; i=3: (50-80 + 55-70 + 0)/3
    assert C.bwt_incclip(R) == pytest.approx(((85 - 80) / 2 + (-30 - 15) / 3) / 2)


def test_bwt_standard():
    assert C.bwt_standard(R) == pytest.approx(((50 - 80) + (55 - 70)) / 2)


def test_forgetting_uses_the_max_before_the_end():
    assert C.forgetting_per_task(R) == pytest.approx([85 - 50, 70 - 55])
    assert C.forgetting(R) == pytest.approx(25.0)


def test_forgetting_rate_dha():
    fr = C.forgetting_rate_per_task(R)
    assert fr == pytest.approx([100 * 30 / 80, 100 * 15 / 70])
    assert C.average_forgetting_rate(R) == pytest.approx((100 * 30 / 80 + 100 * 15 / 70) / 2)
    Z = [[0.0, 1.0], [0.0, 9.0]]
    assert C.forgetting_rate_per_task(Z) == [None] and C.average_forgetting_rate(Z) is None


def test_fwt_needs_zero_shot_row():
    assert C.fwt(R, ZS) == pytest.approx(((10 - 5) + (12 - 3)) / 2)
    assert C.fwt(R, None) is None


def test_so_far_vs_final():
    cum = [[40.0, None, None], [35.0, 50.0, None], [30.0, 45.0, 60.0]]
    rows = C.so_far_vs_final(cum)
    assert [(r["so_far"], r["final"], r["delta"]) for r in rows] == [
        (40, 30, -10),
        (50, 45, -5),
        (60, 60, 0),
    ]


def test_missing_entries_and_small_T():
    Rn = [[80.0, None], [None, 70.0]]
    assert C.bwt_standard(Rn) is None and C.average_final(Rn) is None
    assert C.bwt_incclip([[50.0]]) is None and C.bwt_standard([[50.0]]) is None
    assert C.forgetting([[50.0]]) is None
    s = C.summary(R, ZS)
    assert s["fwt"] == pytest.approx(7.0) and s["final_row"] == [50.0, 55.0, 90.0]
    with pytest.raises(ValueError):
        C.as_matrix([[1.0, 2.0]])


def test_zeroshot_image_folder(tmp_path, fake_model):
    from PIL import Image

    from cvl.evaluation.zeroshot import scan_image_folder, zeroshot_folder

    for cls, rgb in (("red", (250, 10, 10)), ("blue", (10, 10, 250))):
        (tmp_path / cls).mkdir()
        for i in range(3):
            Image.new("RGB", (20, 20), rgb).save(tmp_path / cls / f"{i}.png")
    paths, labels, names = scan_image_folder(tmp_path)
    assert names == ["blue", "red"] and labels == [0, 0, 0, 1, 1, 1]
    r = zeroshot_folder(
        fake_model, tmp_path, ["a {} square", "a photo of a {} thing"], batch_size=4
    )
    assert r["top1"] == 100 and r["n"] == 6 and r["top5"] is None
    (tmp_path / "classnames.txt").write_text("blue\n")
    from cvl.errors import CvlError

    with pytest.raises(CvlError, match="1 names for 2 class folders"):
        scan_image_folder(tmp_path)


def test_seen_so_far_curve_and_compare_plots(tmp_path):
    """The comparison curve: mean of R[k][0..k] after task k; a joint run sits at the end."""
    from cvl.evaluation.comparison import plot_compare, seen_so_far

    seq = {
        "run_name": "seq",
        "tasks": ["a", "b", "c"],
        "rows": ["00-a", "01-b", "02-c"],
        "matrices": {"Rm": [[60, 10, 0], [40, 80, 20], [30, 50, 90]]},
    }
    joint = {
        "run_name": "joint",
        "tasks": ["a", "b", "c"],
        "rows": ["02-c"],
        "matrices": {"Rm": [[70, 75, 80]]},
    }
    assert seen_so_far(seq, "Rm") == [60, 60, pytest.approx(170 / 3)]  # not (40+80+20)/3
    assert seen_so_far(joint, "Rm") == [None, None, 75]
    assert plot_compare([seq, joint], "Rm", tmp_path / "c.png") == tmp_path / "c.png"
    assert (tmp_path / "c.png").stat().st_size > 0
    assert plot_compare([seq], "TR@1", tmp_path / "none.png") is None  # no such matrix


def test_compare_table_json_and_benchmark_columns(tmp_path):
    """`cvl eval --compare` files: one row per run; each benchmark's columns are the FINAL
    checkpoint's values (last row), a run without that benchmark gets '–' / null; NaN -> null."""
    from cvl.evaluation.comparison import compare_table, write_compare

    a = {
        "run_name": "a",
        "method_label": "seqft",
        "tasks": ["t0", "t1"],
        "rows": ["00-t0", "01-t1"],
        "matrices": {},
        "final": {"Rm": 40.0, "TR@1": float("nan")},
        "continual": {"Rm": {"average_final": 50.0, "bwt_standard": -12.5}},
        "benchmarks": {
            "coco-5k": {
                "rows": ["00-t0", "01-t1"],
                "metrics": {"TR@1": [30.0, 20.0], "Rm": [35.0, 25.0]},
            }
        },
    }
    b = {
        "run_name": "b",
        "method_label": "modx",
        "tasks": ["t0", "t1"],
        "rows": ["00-t0", "01-t1"],
        "matrices": {},
        "final": {"Rm": 45.0},
        "continual": {"Rm": {"bwt_standard": 2.0}},
    }
    headers, rows = compare_table([a, b])
    assert headers[:2] == ["run", "method"] and headers[-3:] == [
        "coco-5k TR@1",
        "coco-5k IR@1",
        "coco-5k Rm",
    ]
    col = {h: i for i, h in enumerate(headers)}
    assert rows[0][col["coco-5k TR@1"]] == "20.00" and rows[0][col["coco-5k Rm"]] == "25.00"
    assert rows[0][col["coco-5k IR@1"]] == "–" and rows[1][col["coco-5k Rm"]] == "–"
    assert rows[0][col["BWT(Rm)"]] == "-12.50" and rows[1][col["BWT(Rm)"]] == "+2.00"
    files = write_compare([a, b], tmp_path, plots=False)
    assert sorted(p.name for p in files) == ["compare.csv", "compare.json", "compare.md"]
    j = json.loads((tmp_path / "compare.json").read_text())
    assert j["columns"] == headers
    assert j["runs"][0]["coco-5k Rm"] == 25.0 and j["runs"][0]["TR@1"] is None  # NaN -> null
    assert j["runs"][1]["coco-5k TR@1"] is None and j["runs"][1]["avg Rm"] is None
    assert "coco-5k" in (tmp_path / "compare.md").read_text()
