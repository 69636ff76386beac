"""The command line on a tiny checkpoint: exit codes and report files."""

import json

from llama_parity.cli import main


def test_compare_writes_json_and_exits_zero_on_drift(tiny_dir, tmp_path, capsys):
    out, page = tmp_path / "r.json", tmp_path / "r.html"
    rc = main(["compare", str(tiny_dir("gqa")), "--random-tokens", "2x24", "--policy", "bf16",
               "--json", str(out), "--html", str(page), "--no-colour"])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    report = json.loads(out.read_text())
    assert report["verdict"] in ("exact", "drift") and report["first_divergence"] is None
    assert "data:image/png;base64," in page.read_text()
    assert "layer component" in printed and "jaxmodel vs torchref at bf16" in printed


def test_unknown_policy_is_a_clear_error(tiny_dir, capsys):
    rc = main(["compare", str(tiny_dir("gqa")), "--random-tokens", "1x8", "--policy", "fp12"])
    assert rc == 2 and "unknown precision policy 'fp12'" in capsys.readouterr().err


def test_compare_writes_both_reports_to_out_dir_by_default(tiny_dir, tmp_path, capsys):
    rc = main(["compare", str(tiny_dir("gqa")), "--random-tokens", "1x16", "--no-colour",
               "--no-teacher-forcing", "--out-dir", str(tmp_path / "rep")])
    assert rc == 0, capsys.readouterr().out
    written = sorted(p.name for p in (tmp_path / "rep").iterdir())
    assert written == ["jaxmodel-vs-torchref-fp32.html", "jaxmodel-vs-torchref-fp32.json"]
    assert json.loads((tmp_path / "rep" / written[1]).read_text())["policy"]["name"] == "fp32"


def test_compare_decode_judges_each_step_and_writes_its_json(tiny_dir, tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = main(["compare", str(tiny_dir("gqa")), "--random-tokens", "2x12", "--decode", "3", "--json", str(out),
               "--no-files", "--no-teacher-forcing"])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    assert "decode of 3 steps" in printed
    decoded = json.loads((tmp_path / "r-decode.json").read_text())
    assert decoded["steps"] == 3 and len(decoded["per_step"]) == 3 and decoded["verdict"] in ("exact", "drift")


def test_compare_generate_reports_where_greedy_parts_and_writes_its_json(tiny_dir, tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = main(["compare", str(tiny_dir("gqa")), "--random-tokens", "3x10", "--generate", "6", "--json", str(out),
               "--no-files", "--no-teacher-forcing"])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    greedy = json.loads((tmp_path / "r-greedy.json").read_text())
    assert greedy["verdict"] in ("exact", "drift") and len(greedy["rows"]) == 3
