"""``lenscope circuit``: the JSON fields the issue names, files, and one-line errors (exit 2)."""

import json

from typer.testing import CliRunner

from lenscope.cli import app
from lenscope.data.contrast import ContrastPair, write_contrast_csv
from tests.tolerances import assert_same_computation

runner = CliRunner()
CLEAN, CORRUPTED = "the cat sat on the mat", "the dog sat on the mat"


def run(*args):
    return runner.invoke(app, list(args))


def test_edges_json_with_check_and_files(tmp_path):
    r = run("circuit", CLEAN, CORRUPTED, "--model", "tiny:gpt2", "--target", "#5", "--foil", "#7", "--method",
            "eap-ig", "--level", "edges", "--check", "exact", "--top", "4", "--json", "--png",
            str(tmp_path / "c.png"), "--out", str(tmp_path / "out"), "--html", str(tmp_path / "new" / "c.html"))
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout.strip().splitlines()[-1])
    for key in ("method", "level", "n", "metric_clean", "metric_corrupted", "seconds", "nodes", "edges",
                "faithfulness", "check"):
        assert key in d
    assert d["method"] == "eap-ig" and d["level"] == "edges" and d["n"] == 1 and len(d["edges"]) == 4
    assert set(d["edges"][0]) == {"src", "dst", "score"}
    assert set(d["faithfulness"][0]) == {"k", "fraction", "value"} and d["faithfulness"][-1]["fraction"] == 1.0
    assert set(d["check"]) >= {"spearman", "top10_recall", "false_negatives"}
    assert (tmp_path / "c.png").stat().st_size > 1000
    assert_same_computation(json.loads((tmp_path / "out" / "circuit.json").read_text())["edges"], d["edges"],
                            why="one result written to two files")
    from lenscope.circuits import Circuit, EdgeAttribution, Faithfulness

    scores = EdgeAttribution.load(tmp_path / "out" / "scores.safetensors")
    assert scores.n_edges == d["total"]
    curve = Faithfulness.load(tmp_path / "out" / "faithfulness.safetensors")
    assert_same_computation((scores.edges(4), curve.points()), (d["edges"], d["faithfulness"]),
                            why="one result, saved and read back")
    assert len(Circuit.load(tmp_path / "out" / "circuit.safetensors")) == d["smallest"]
    page = (tmp_path / "new" / "c.html").read_text()  # its folder is created
    assert 'data-section="circuit"' in page and "<script src" not in page and 'href="http' not in page


def test_nodes_from_a_csv(tmp_path):
    path = write_contrast_csv([ContrastPair(CLEAN, CORRUPTED, "#5", "#7"),
                               ContrastPair("a cat sat on a mat", "a dog sat on a mat", "#5", "#7")],
                              tmp_path / "pairs.csv")
    r = run("circuit", "--model", "tiny:llama", "--data", str(path), "--method", "atp", "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout.strip().splitlines()[-1])
    assert d["level"] == "nodes" and d["n"] == 2 and d["edges"] == []
    names = {n["name"] for n in d["nodes"]}
    assert {"embed", "L0H0", "L0.mlp"} <= names


def test_bad_input_is_one_line_and_exit_2(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("clean,corrupted,target,foil\nthe cat sat,the dog sat,#5,#7\nthe cat sat,the dog sat down,#5,#7\n")
    cases = [
        ("circuit", "the cat", "the cat sat", "--model", "tiny:gpt2", "--target", "#5", "--foil", "#7"),
        ("circuit", CLEAN, CORRUPTED, "--model", "tiny:gpt2", "--target", "#5"),
        ("circuit", CLEAN, CORRUPTED, "--model", "tiny:bert", "--target", "#5", "--foil", "#7"),
        ("circuit", "--model", "tiny:gpt2", "--data", str(path)),
        ("circuit", CLEAN, CORRUPTED, "--model", "tiny:gpt2", "--target", "#5", "--foil", "#7", "--method", "eap",
         "--level", "nodes"),
        ("circuit", CLEAN, CORRUPTED, "--model", "tiny:gpt2", "--target", "#5", "--foil", "#7", "--method", "x"),
    ]
    cases.append(("circuit", CLEAN, CORRUPTED, "--model", "tiny:gpt2", "--target", "#5", "--foil", "#7", "--html",
                  str(tmp_path)))
    wants = ["tokens", "--foil", "causal decoder", "row 2", "--level edges", "unknown --method", "is a folder"]
    for args, want in zip(cases, wants):
        r = run(*args)
        assert r.exit_code == 2, (args, r.output)
        lines = [x for x in r.output.strip().splitlines() if x.startswith("error:")]
        assert len(lines) == 1 and want in lines[0], (want, r.output)
