"""The resumable records runner: torn last line, resume after N, input order, code versions, damaged files."""

from __future__ import annotations

import json
import random

import pytest

from lenscope.distributed.records import Records, RecordsError, in_order, read_records
from lenscope.errors import InputError
from lenscope.version import code_version


def _square(todo):
    """A sequential compute: ``(position, record)`` in the order asked."""
    return ((i, {"index": i, "value": i * i}) for i in todo)


def _shuffled(todo, seed=0):
    """A compute whose results complete out of order (as a Ray pool's do)."""
    out = list(_square(todo))
    random.Random(seed).shuffle(out)
    return iter(out)


def test_appends_one_line_per_item_in_the_usual_json_format(tmp_path):
    path = tmp_path / "records.jsonl"
    recs = Records(path)
    got = list(recs.run(range(4), _square))
    assert [i for i, _ in got] == [0, 1, 2, 3]
    expected = "".join(json.dumps({"index": i, "value": i * i}) + "\n" for i in range(4))
    assert path.read_text() == expected  # json.dumps with its default separators, one record a line
    assert read_records(path) == [{"index": i, "value": i * i} for i in range(4)]


def test_out_of_order_completion_is_written_and_returned_in_input_order(tmp_path):
    path = tmp_path / "records.jsonl"
    seen = []
    for i, r in Records(path).run(range(7), lambda todo: _shuffled(todo, seed=3)):
        seen.append(i)
        # the record of every item released so far is on disk when it is released
        assert [x["index"] for x in read_records(path)] == seen
        assert r == {"index": i, "value": i * i}
    assert seen == list(range(7))
    seq = tmp_path / "seq.jsonl"
    list(Records(seq).run(range(7), _square))
    assert path.read_bytes() == seq.read_bytes()


def test_resume_after_n_computes_only_the_rest(tmp_path):
    path = tmp_path / "records.jsonl"
    list(Records(path).run(range(3), _square))  # an interrupted run of 8 items, stopped after 3
    recs = Records(path)
    assert len(recs) == 3
    todo = recs.todo(list(range(8)))
    assert todo == [3, 4, 5, 6, 7]
    asked = []

    def compute(t):
        asked.extend(t)
        return _shuffled(t, seed=1)

    assert [i for i, _ in recs.run(todo, compute)] == todo and asked == todo
    full = tmp_path / "full.jsonl"
    list(Records(full).run(range(8), _square))
    assert path.read_bytes() == full.read_bytes()
    assert [recs.by_key()[i] for i in range(8)] == read_records(full)


def test_torn_last_line_is_dropped_and_rewritten(tmp_path):
    full = tmp_path / "full.jsonl"
    list(Records(full).run(range(5), _square))
    lines = full.read_text().splitlines(keepends=True)
    for torn in (lines[3][: len(lines[3]) // 2], lines[3].rstrip("\n")):  # cut short; complete but no newline
        path = tmp_path / "records.jsonl"
        path.write_text("".join(lines[:3]) + torn)
        recs = Records(path)
        assert len(recs) == 3 and path.read_text() == "".join(lines[:3])  # the torn line is cut from the file
        list(recs.run(recs.todo(list(range(5))), _square))
        assert path.read_bytes() == full.read_bytes()


def test_a_malformed_middle_line_is_an_error_naming_file_and_line(tmp_path):
    path = tmp_path / "records.jsonl"
    list(Records(path).run(range(4), _square))
    lines = path.read_text().splitlines(keepends=True)
    damaged = "".join(lines[:1]) + "{not json\n" + "".join(lines[2:])
    path.write_text(damaged)
    with pytest.raises(RecordsError, match=r"records\.jsonl: line 2 is not a JSON record") as e:
        Records(path)
    assert isinstance(e.value, InputError)
    assert path.read_text() == damaged  # nothing was cut or rewritten
    path.write_text(lines[0] + "[1, 2]\n" + lines[2])  # JSON, but not a record
    with pytest.raises(RecordsError, match="line 2"):
        read_records(path)


def test_keys_done_predicate_and_later_records_win(tmp_path):
    path = tmp_path / "records.jsonl"
    recs = Records(path, key="id")
    recs.append([{"id": "a", "methods": ["x"]}, {"id": "b", "methods": ["x"]}])
    recs.append([{"id": "a", "methods": ["x", "y"]}])
    back = Records(path, key=lambda r: r["id"])
    assert back.by_key()["a"]["methods"] == ["x", "y"]
    assert back.todo(["a", "b", "c"], done=lambda r, i: "y" in r["methods"]) == [1, 2]


def test_keep_cuts_to_the_records_a_saved_state_counts(tmp_path):
    path = tmp_path / "records.jsonl"
    list(Records(path).run(range(4), _square))
    first = path.read_text().splitlines(keepends=True)
    with path.open("a") as fh:
        fh.write('{"index": 4, "val')
    recs = Records(path)
    assert recs.keep(2) == [{"index": 0, "value": 0}, {"index": 1, "value": 1}]
    assert path.read_text() == "".join(first[:2])
    list(recs.run(range(2, 4), _square))
    assert path.read_text() == "".join(first)
    with pytest.raises(RecordsError, match="fewer than"):
        Records(path).keep(9)


def test_version_mismatch_is_refused_unless_forced(tmp_path):
    path = tmp_path / "records.jsonl"
    recs = Records(path, key="id")
    recs.append([{"id": "a", "version": code_version()}, {"id": "b"}, {"id": "c", "version": "0.0.1"}])
    with pytest.raises(InputError, match=r"another code version \(1 of version unrecorded, 1 of version 0\.0\.1; "
                                         r"this is .*--force"):
        recs.check_version(True, where="out")
    assert recs.check_version(False) == code_version()  # nothing left to compute: nothing mixed
    assert recs.check_version(True, force=True) == code_version()
    same = Records(tmp_path / "same.jsonl", key="id")
    same.append([{"id": "a", "version": "v2"}])
    assert same.check_version(True, version="v2") == "v2"


def test_fresh_start_memory_only_and_fsync(tmp_path):
    path = tmp_path / "records.jsonl"
    list(Records(path).run(range(3), _square))
    assert len(Records(path, resume=False)) == 0 and not path.exists()
    mem = Records(None)
    assert [i for i, _ in mem.run([2, 0], _square)] == [2, 0] and len(mem) == 2
    synced = Records(path, fsync=True)
    list(synced.run(range(2), _square))
    assert read_records(path) == [{"index": 0, "value": 0}, {"index": 1, "value": 1}]


def test_in_order_checks_the_stream_and_closes_it():
    closed = []

    def stream():
        try:
            yield 1, "b"
            yield 0, "a"
            yield 2, "c"
        finally:
            closed.append(True)

    it = in_order(stream(), [0, 1, 2])
    assert next(it) == (0, "a")
    it.close()
    assert closed == [True]  # a parallel map is stopped when the caller stops reading
    with pytest.raises(RecordsError, match="not asked for"):
        list(in_order(iter([(5, None)]), [0]))
    with pytest.raises(RecordsError, match="ended early"):
        list(in_order(iter([(0, None)]), [0, 1]))
    assert list(in_order(iter([]), [])) == []
