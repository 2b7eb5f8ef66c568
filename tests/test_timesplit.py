"""Time-ordered streams (`cvl build-stream table --time-col`, cvl.streams.timesplit): dates
read by explicit rules (missing and unreadable ones counted, never guessed), periods, the
first "up to" task, per-period retrieval sets as benchmarks, the manifest's time layout and
the build report's per-period counts."""

from __future__ import annotations

import csv
import datetime as dt
import json

import pytest
from PIL import Image

from cvl.cli import main
from cvl.errors import CvlError
from cvl.streams.manifest import load_manifest
from cvl.streams.timesplit import Periods, parse_time


@pytest.mark.parametrize(
    "value, want",
    [
        ("2014-03-05", dt.datetime(2014, 3, 5)),
        ("2014-03-05T23:30:00Z", dt.datetime(2014, 3, 5, 23, 30)),
        ("2014-03-05T23:30:00-02:00", dt.datetime(2014, 3, 6, 1, 30)),  # to UTC
        ("2014/03/05", dt.datetime(2014, 3, 5)),
        ("2014-03", dt.datetime(2014, 3, 1)),
        ("2014", dt.datetime(2014, 1, 1)),
        (2014, dt.datetime(2014, 1, 1)),
        ("201403", dt.datetime(2014, 3, 1)),  # TiC's month names
        ("20140305", dt.datetime(2014, 3, 5)),
        (1394000000, dt.datetime(2014, 3, 5, 6, 13, 20)),  # Unix seconds (YFCC)
        ("1394000000", dt.datetime(2014, 3, 5, 6, 13, 20)),
        (dt.date(2014, 3, 5), dt.datetime(2014, 3, 5)),
        (None, None),
        ("  ", None),
        (float("nan"), None),
    ],
)
def test_parse_time_auto(value, want):
    assert parse_time(value) == want


@pytest.mark.parametrize("value", ["last summer", "2014-13-01", "201413", "2014-02-30", True])
def test_unreadable_dates_raise(value):
    with pytest.raises(ValueError, match="not a date"):
        parse_time(value)


def test_explicit_formats():
    assert parse_time("1394000000000", "epoch_ms") == dt.datetime(2014, 3, 5, 6, 13, 20)
    assert parse_time("2014", "epoch") == dt.datetime(1970, 1, 1, 0, 33, 34)  # no year guess
    assert parse_time("05.03.2014", "%d.%m.%Y") == dt.datetime(2014, 3, 5)
    with pytest.raises(ValueError):
        parse_time("2014", "iso")


def test_periods():
    d = dt.datetime(2014, 8, 5)
    q, m = Periods.make("quarter", None), Periods.make("month", None)
    assert q.label(q.key(d)) == "2014-Q3" and m.label(m.key(d)) == "2014-08"
    assert q.key_of_label("2014-Q2", "--first-until") == (2014, 2)
    c = Periods.make("year", "2015,2016-07-01")
    labels = [c.label(c.key(dt.datetime(*x))) for x in ((2014, 5, 1), (2015, 1, 1), (2016, 7, 2))]
    assert labels == ["until-2015-01-01", "2015-01-01", "2016-07-01"]
    with pytest.raises(CvlError, match="increasing"):
        Periods.make("year", "2016,2015")
    with pytest.raises(CvlError, match="not a date"):
        Periods.make("year", "soon")


def _table(tmp_path, rows) -> str:
    """A CSV of local images (id, path, caption, date)."""
    imgs = tmp_path / "imgs"
    imgs.mkdir(exist_ok=True)
    path = tmp_path / "meta.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["uid", "image", "caption", "date"])
        for i, date in enumerate(rows):
            Image.new("RGB", (16, 16), (i * 7 % 255, 40, 90)).save(imgs / f"{i}.jpg")
            w.writerow([f"u{i}", f"imgs/{i}.jpg", f"picture {i}", date])
    return str(path)


def _build(tmp_path, rows, *extra) -> tuple:
    out = tmp_path / "s"
    argv = ["build-stream", "table", "--input", _table(tmp_path, rows), "--url-col", "image"]
    argv += ["--caption-col", "caption", "--id-col", "uid", "--time-col", "date", "--quiet"]
    assert main([*argv, *extra, "--out", str(out)]) in (0, None)
    return load_manifest(out), json.loads((out / "build_report.json").read_text()), out


def test_time_split_of_a_table_with_dates(tmp_path):
    """4 pairs a year 2014-2017 + a missing, an unreadable and a 2019 date: 2014-2015 merged
    into the first task, 1 retrieval pair per period held out, 2019 after --until 2017."""
    rows = [f"{y}-0{k + 1}-15" for y in (2014, 2015, 2016, 2017) for k in range(4)]
    rows += ["", "yesterday", "2019-01-01"]
    m, rep, out = _build(
        tmp_path, rows, "--first-until", "2015", "--until", "2017", "--test", "1", "--val", "1"
    )
    assert m.task_order == ["2014-2015", "2016", "2017"]
    assert [m.tasks[t].train.count for t in m.task_order] == [5, 2, 2]  # 8 - 2 test - 1 val
    assert m.time["periods"] == ["2014", "2015", "2016", "2017"]
    assert m.time["tasks"] == {"2014-2015": ["2014", "2015"], "2016": ["2016"], "2017": ["2017"]}
    assert m.time["eval"] == {p: f"ret-{p}" for p in m.time["periods"]}
    assert {b: x.shards.count for b, x in m.benchmarks.items()} == dict.fromkeys(
        ("ret-2014", "ret-2015", "ret-2016", "ret-2017"), 1
    )
    # the merged task's test set = its periods' retrieval sets (one sub-folder each)
    assert m.eval_sets["test"].tasks["2014-2015"].count == 2
    assert m.benchmarks["ret-2015"].shards.shards == ["eval/test/2014-2015/2015/000000.tar"]
    assert m.benchmarks["ret-2016"].shards.shards == m.eval_sets["test"].tasks["2016"].shards
    assert rep["dropped"] == {"missing_date": 1, "bad_date": 1, "after_until": 1}
    p14, p15 = rep["time"]["periods"]["2014"], rep["time"]["periods"]["2015"]
    assert p14["task"] == p15["task"] == "2014-2015" and p14["test"] == p15["test"] == 1
    assert (p14["train"] + p15["train"], p14["val"] + p15["val"]) == (5, 1)
    assert rep["time"]["periods"]["2016"] == {"task": "2016", "train": 2, "val": 1, "test": 1}
    # each sample keeps its raw date and its period
    import webdataset as wds

    meta = [
        json.loads(s["json"])
        for s in wds.WebDataset(
            str(out / m.benchmarks["ret-2015"].shards.shards[0]), shardshuffle=False
        )
    ]
    assert meta[0]["period"] == "2015" and meta[0]["date"].startswith("2015-")


def test_time_split_quarters_and_options(tmp_path, capsys):
    rows = ["2014-01-05", "2014-02-05", "2014-05-05", "2014-06-05", "2014-11-05", "2014-12-05"]
    m, rep, _ = _build(tmp_path, rows, "--period", "quarter", "--since", "2014-Q2")
    assert m.task_order == ["2014-Q2", "2014-Q4"] and not m.benchmarks
    assert rep["dropped"] == {"before_since": 2}
    argv = ["build-stream", "table", "--input", str(tmp_path / "meta.csv"), "--url-col", "image"]
    argv += ["--caption-col", "caption", "--first-until", "2016", "--out", str(tmp_path / "o")]
    assert main(argv) == 2
    assert "--first-until: only with --time-col" in capsys.readouterr().err


def _ids(tmp_path):
    f = tmp_path / "ids.json"
    f.write_text(json.dumps({"2014": ["u0"]}))
    return f


def test_time_col_refuses_other_splits(tmp_path):
    from cvl.streams.pipeline import BuildOptions
    from cvl.streams.table import build_table

    p = _table(tmp_path, ["2014"])
    opts = BuildOptions(out=tmp_path / "o", progress=False, log=lambda m: None)
    with pytest.raises(CvlError, match="drop --task-col"):
        build_table(
            [p],
            opts,
            url_col="image",
            caption_col="caption",
            task_col="uid",
            time={"column": "date"},
        )
    with pytest.raises(CvlError, match="drop --test"):
        build_table(
            [p],
            opts,
            url_col="image",
            caption_col="caption",
            test=3,
            time={"column": "date", "eval_ids": str(_ids(tmp_path))},
        )
    with pytest.raises(CvlError, match="no dated pair up to it"):
        build_table(
            [p],
            opts,
            url_col="image",
            caption_col="caption",
            time={"column": "date", "first_until": "2010"},
        )


def test_time_split_of_webdataset_shards(tmp_path):
    """img2dataset's output (KEY.jpg / KEY.txt / KEY.json with its saved columns) as the source:
    the images are read from the shard, the date from KEY.json; a sample with no date is counted."""
    import io

    import webdataset as wds

    shard = tmp_path / "00000.tar"
    with wds.TarWriter(str(shard)) as w:
        for i, ts in enumerate(["2015-03-01", "2015-06-01", "2016-01-02", "2016-02-02", None]):
            buf = io.BytesIO()
            Image.new("RGB", (20, 20), (200, 10 * i, 40)).save(buf, format="JPEG")
            meta = {
                "uid": f"u{i}",
                "url": f"http://images.cvl.invalid/{i}.jpg",
                "status": "success",
            }
            w.write(
                {"__key__": f"{i:09d}", "jpg": buf.getvalue(), "txt": f"pic {i}"}
                | {"json": json.dumps(meta | ({"timestamp": ts} if ts else {})).encode()}
            )
    out = tmp_path / "s"
    argv = ["build-stream", "table", "--input", str(shard), "--url-col", "jpg", "--caption-col"]
    argv += ["txt", "--id-col", "uid", "--time-col", "timestamp", "--test", "1", "--quiet"]
    assert main([*argv, "--out", str(out)]) in (0, None)
    m = load_manifest(out)
    assert m.task_order == ["2015", "2016"] and [m.tasks[t].train.count for t in m.task_order] == [
        1,
        1,
    ]
    rep = json.loads((out / "build_report.json").read_text())
    assert rep["dropped"] == {"missing_date": 1} and "download" not in rep  # nothing fetched
    from cvl.data.reader import PairDataset

    ((_, cap, meta),) = [PairDataset.from_shards(m.train_shards("2016")).read_raw(0)]
    assert cap.startswith("pic ") and meta["timestamp"].startswith("2016")


# -- issue 47: time units mean what they say -------------------------------------------------------
@pytest.mark.parametrize(
    "cell, value, want",
    [
        ("2019.0", 2019.0, dt.datetime(2019, 1, 1)),  # a 4-digit number: a year
        ("201903.0", 201903.0, dt.datetime(2019, 3, 1)),
        ("-86400", -86400, dt.datetime(1969, 12, 31)),  # negative: Unix seconds
        ("-1.5", -1.5, dt.datetime(1969, 12, 31, 23, 59, 58, 500000)),
        ("1394000000.5", 1394000000.5, dt.datetime(2014, 3, 5, 6, 13, 20, 500000)),
        ("1.3940e9", 1.394e9, dt.datetime(2014, 3, 5, 6, 13, 20)),
    ],
)
def test_a_number_in_a_csv_cell_is_the_same_date_as_in_json(cell, value, want):
    """The docs: 4/6/8-digit numbers are YYYY/YYYYMM/YYYYMMDD, any other number Unix seconds,
    whether JSON gives the number or a CSV cell its text (was: bad_date for the text)."""
    assert parse_time(cell) == parse_time(value) == want


def test_an_upper_bound_means_the_end_of_the_period_it_names(tmp_path):
    """--period month: `--first-until 2014` merges all of 2014 (12 months, named by what it
    spans), `--until 2015` keeps December 2015, `--since 2014` starts in January (was: the
    first task 2014-01 alone and everything after 2015-01 dropped)."""
    rows = [f"{y}-{mo:02d}-10" for y in (2014, 2015, 2016) for mo in (1, 6, 12)]
    m, rep, _ = _build(
        tmp_path, rows, "--period", "month", "--first-until", "2014", "--until", "2015"
    )
    assert m.task_order == ["2014-01-2014-12", "2015-01", "2015-06", "2015-12"]
    assert m.time["tasks"]["2014-01-2014-12"] == ["2014-01", "2014-06", "2014-12"]
    assert rep["dropped"] == {"after_until": 3}
    q = Periods.make("quarter", None)
    assert q.key_of_label("2016", "--until", end=True) == (2016, 4)
    assert q.key_of_label("2016", "--since") == (2016, 1)
    assert Periods.make("month", None).key_of_label("2016-Q2", "--until", end=True) == (2016, 6)


def test_a_merged_task_between_cut_points_is_named_by_what_it_spans(tmp_path):
    """Intervals until-2015-01-01 and 2015-01-01 (up to the cut 2016-07-01) merged by
    --first-until 2015-06: the task spans until 2016-07-01 (was 'until-2015-01-01-2015-01-01')."""
    rows = ["2014-05-01", "2014-06-01", "2015-03-01", "2015-04-01", "2016-08-01", "2016-09-01"]
    m, _, _ = _build(tmp_path, rows, "--cuts", "2015,2016-07-01", "--first-until", "2015-06")
    assert m.task_order == ["until-2016-07-01", "2016-07-01"]
    assert m.time["tasks"]["until-2016-07-01"] == ["until-2015-01-01", "2015-01-01"]
    c = Periods.make("year", "2015,2016-07-01")
    assert c.span_label((1,), (2,)) == "from-2015-01-01"
    assert c.span_label((0,), (2,)) == "all"


# -- issue 47: a build never loses an evaluation set without saying so -----------------------------
def _bad(path) -> None:
    path.write_bytes(b"\xff\xd8 not a jpeg")


def _read_report(out) -> dict:
    return json.loads((out / "build_report.json").read_text())


def _written(m) -> int:
    """Pairs the manifest references: training sets, eval sets."""
    n = sum(m.tasks[t].train.count for t in m.task_order)
    return n + sum(ss.count for es in m.eval_sets.values() for ss in es.tasks.values())


def test_held_out_pairs_are_drawn_from_pairs_whose_image_reads(tmp_path):
    """The pair drawn as 2015's retrieval set has an unreadable image: it is replaced by a
    readable 2015 pair (was: ret-2015 silently gone); the report counts what was written."""
    rows = ["2014-03-01"] * 3 + ["2015-03-01"] * 6
    m, _, out = _build(tmp_path, rows, "--test", "1")
    import webdataset as wds

    (drawn,) = [
        json.loads(s["json"])["id"]
        for s in wds.WebDataset(
            str(out / m.benchmarks["ret-2015"].shards.shards[0]), shardshuffle=False
        )
    ]
    # the drawn pair and one more 2015 pair turn out unreadable
    _bad(tmp_path / "imgs" / f"{drawn[1:]}.jpg")
    other = next(i for i in range(3, 9) if f"u{i}" != drawn)
    _bad(tmp_path / "imgs" / f"{other}.jpg")
    out2 = tmp_path / "s2"
    argv = ["build-stream", "table", "--input", str(tmp_path / "meta.csv"), "--url-col", "image"]
    argv += ["--caption-col", "caption", "--id-col", "uid", "--time-col", "date", "--quiet"]
    assert main([*argv, "--test", "1", "--out", str(out2)]) in (0, None)
    m2, rep = load_manifest(out2), _read_report(out2)
    assert m2.benchmarks["ret-2015"].shards.count == 1
    assert [m2.tasks[t].train.count for t in m2.task_order] == [2, 3]  # 6 - 2 bad - 1 held out
    assert rep["dropped"] == {"bad_image": 2} and rep["kept_total"] == _written(m2) == 7
    assert "warnings" not in rep


def test_an_evaluation_set_that_is_lost_is_reported(tmp_path):
    """--eval-ids with an id that matches no pair and none of 2015's; 2016 whose only pair is
    held out (no training pair: the task is left out with its retrieval set): each one a
    warning, and the report counts only the pairs written (was: silence, and 2016's pair
    counted as kept)."""
    rows = ["2014-03-01", "2014-04-01", "2015-03-01", "2015-04-01", "2016-03-01"]
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps({"2014": ["u0"], "2016": ["u4"], "2099": ["nope"]}))
    m, rep, out = _build(tmp_path, rows, "--eval-ids", str(ids))
    assert m.task_order == ["2014", "2015"] and list(m.benchmarks) == ["ret-2014"]
    w = "\n".join(rep["warnings"])
    assert "--eval-ids: 1 of 3 ids match no dated pair in range (e.g. nope)" in w
    assert "period 2015 has no retrieval set (ret-2015): no pair of it is in --eval-ids" in w
    assert "task '2016': its held-out pairs (test 1) left out with it" in w
    assert "period 2016 has no retrieval set (ret-2016): its task '2016' was left out" in w
    assert rep["kept_total"] == _written(m) == 4 and rep["dropped"] == {"task_left_out": 1}
    assert not list(out.glob("eval/test/2016/**/*.tar"))  # its shards are not left behind
    (tmp_path / "n").mkdir()
    _, rep3, _ = _build(tmp_path / "n", rows)  # nothing held out at all
    assert any("the stream has no evaluation set" in x for x in rep3["warnings"])
