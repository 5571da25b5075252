"""The README and docs/performance.md stay true: the settings table is the config schema's,
the performance tables are rendered from result files, the README stays short and keeps
the opening block CI runs. Pure: no Ray."""

from __future__ import annotations

import argparse
import json
import re
import typing
from pathlib import Path

import pytest

from moshray.jobs.bench import report
from moshray.jobs.bench.results import ResultError, load_results, save_result
from moshray.jobs.config import sections, table

ROOT = Path(__file__).parents[1]
README = ROOT / "README.md"


# --------------------------------------------------------------------------- the README


def test_readme_is_under_300_lines():
    assert len(README.read_text().splitlines()) < 300


def test_readme_keeps_the_opening_block_ci_runs():
    lines = README.read_text().splitlines()
    assert lines[0] == "# moshray" and lines[2] == "```bash" and lines[5] == "```"
    assert lines[3].startswith("pip install") and "moshray train" in lines[3]
    # .ci/run: the first line starting with `pip install` that runs pytest
    first = next(line for line in lines if re.match(r"^pip install .*pytest", line))
    assert first == lines[4] and first.endswith("python -m pytest -q tests")


def test_settings_page_table_is_the_schemas():
    args = argparse.Namespace(file=str(ROOT / table.DEFAULT_FILE), check=True, print=False)
    assert table.main(args) == 0, "run `moshray config table` and commit docs/settings.md"


def test_readme_and_performance_page_are_rendered_from_docs_results(monkeypatch):
    monkeypatch.chdir(ROOT)  # the command's defaults are paths relative to the repository
    args = argparse.Namespace(results=report.RESULTS_DIR, template=report.TEMPLATE,
                              out=report.OUT, readme="README.md", check=True)
    assert report.main(args) == 0, "run `moshray bench report` and commit what it wrote"


def test_docs_links_in_the_readme_exist():
    for target in re.findall(r"\]\(((?:docs|infra)/[^)#]+)", README.read_text()):
        assert (ROOT / target).exists(), target


# --------------------------------------------------------------------------- settings table


def test_every_setting_has_a_row_with_its_default_and_description():
    rows = table.rows()
    assert [key for key, _, _ in rows] == sections.valid_keys()
    by_key = {key: (default, doc) for key, default, doc in rows}
    assert by_key["training.lr"][0] == "0.0003"
    assert by_key["training.max_steps"][0] == "none"
    assert by_key["model.moe_grid"][0] == "[4, 4]"
    assert by_key["run_dir"][0] == "none" and by_key["name"][0] == "none"
    assert all(doc.strip() for _, doc in by_key.values())
    modes = typing.get_args(typing.get_type_hints(sections.TrainingSection)["mode"])
    assert by_key["training.mode"][1].endswith(  # a Literal's choices, generated
        "One of " + ", ".join(f"`{m}`" for m in modes) + ".")
    assert "`fp16`" in by_key["training.compression"][1]  # a registry's choices


def test_field_docs_read_the_string_under_each_field():
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class Toy:
        a: int = 1
        """First line
        and second."""
        b: str = "x"  # a comment is not a description

    assert table.field_docs(Toy) == {"a": "First line and second."}


def test_table_check_write_and_bad_markers(tmp_path: Path, capsys):
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{table.BEGIN}\n| stale |\n{table.END}\n\nafter\n")
    args = argparse.Namespace(file=str(readme), check=True, print=False)
    assert table.main(args) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "run `moshray config table`" in err
    assert table.main(argparse.Namespace(file=str(readme), check=False, print=False)) == 0
    text = readme.read_text()
    assert text.startswith("# x\n\n") and text.endswith(f"{table.END}\n\nafter\n")
    assert table.render() in text
    assert table.main(args) == 0
    readme.write_text("# no markers\n")
    assert table.main(args) == 2
    assert "settings:begin" in capsys.readouterr().err


# --------------------------------------------------------------------------- performance


def _write(folder: Path, bench: str, argv: tuple[str, ...], figures: dict, when: float):
    args = argparse.Namespace(results=str(folder), argv=("bench", bench, *argv))
    return save_result(bench, args, figures, now=when)


ALLREDUCE = {"peers": 4, "size_mb": 100.0, "compression": "fp16", "reps": 5,
             "moshray_s": 0.5, "gloo_s": 0.25, "ratio_vs_gloo": 0.5, "max_rel_error": 4e-4,
             "within_bound": True, "kill_one_s": 1.3, "load_average": 2.0,
             "plot": "/tmp/somewhere.png"}


def test_a_bench_writes_one_result_file_per_run(tmp_path: Path):
    path = _write(tmp_path, "allreduce", ("--peers", "4"), ALLREDUCE, 1_790_000_000)
    assert path.name == "allreduce-20260921T141320Z.json"
    data = json.loads(path.read_text())
    assert data["command"] == "moshray bench allreduce --peers 4"
    assert data["date"] == "2026-09-21T14:13:20Z"
    assert data["machine"]["cores"] >= 1
    assert "plot" not in data["figures"] and data["figures"]["ratio_vs_gloo"] == 0.5
    assert save_result("allreduce", argparse.Namespace(results=None), ALLREDUCE) is None


def test_report_renders_the_newest_result_of_each_bench(tmp_path: Path):
    results = tmp_path / "results"
    _write(results, "allreduce", ("--size-mb", "10"), ALLREDUCE | {"ratio_vs_gloo": 0.41},
           1_790_000_000)
    _write(results, "allreduce", ("--size-mb", "100"), ALLREDUCE | {"ratio_vs_gloo": 0.57},
           1_790_086_400)  # a day later
    _write(results, "chaos", (), {"faults": 7, "steps": 90, "lost": 0, "repeated": 0,
                                  "rollbacks": 0, "invariant_failures": []}, 1_790_000_000)
    _write(results, "gpu", ("--out", "x.json"),
           {"cuda": True, "parts": {"steprate": {"ok": True, "samples_per_s": 1234.5}},
            "log": ["long", "list"]}, 1_790_000_000)
    template = tmp_path / "template.md"
    template.write_text("# Perf\n\n<!-- summary -->\n\n" + "".join(
        f"## {h.name}\n\n<!-- result:{h.name} -->\n\nmethod of {h.name}\n\n"
        for h in report.HEADLINES) + "## Others\n\n<!-- others -->\n")
    readme = tmp_path / "README.md"
    readme.write_text(f"# r\n{report.README_BEGIN}\nold\n{report.README_END}\ntail\n")
    out = tmp_path / "docs" / "performance.md"
    out.parent.mkdir()
    args = argparse.Namespace(results=str(results), template=str(template), out=str(out),
                              readme=str(readme), check=True)
    assert report.main(args) == 1  # nothing rendered yet
    assert report.main(argparse.Namespace(**{**vars(args), "check": False})) == 0
    assert report.main(args) == 0

    page = out.read_text()
    assert "`ratio_vs_gloo` 0.57" in page and "0.41" not in page
    assert "moshray bench allreduce --size-mb 100" in page
    assert "2026-09-22" in page
    assert "1 earlier result file(s)" in page
    assert "(../results/allreduce-20260922T141320Z.json)" in page
    assert "method of chaos" in page and "all held" in page
    # a bench with a headline per setting: the separate-hosts one takes only its runs
    netns = page.split("method of chaos\n")[1].split("method of chaos-netns")[0]
    assert "No result file yet: run `moshray bench chaos --schedule long --hosts netns" in netns
    assert "No result file yet: run `moshray bench goodput" in page
    assert "(met)" in page
    others = page.split("## Others")[1]  # a bench without a section: its scalar figures
    assert "### gpu" in others and "moshray bench gpu --out x.json" in others
    assert "| `cuda` | yes |" in others and "| `parts.steprate.samples_per_s` | 1234 |" in others
    assert "long" not in others

    text = readme.read_text()
    assert text.startswith("# r\n") and text.endswith("tail\n")
    summary = text.split(report.README_BEGIN)[1].split(report.README_END)[0]
    assert summary.count("\n| ") == len(report.HEADLINES) + 1  # separator + one per headline
    assert "| `moshray bench allreduce --size-mb 100` | 2026-09-22 | " in summary
    assert "every invariant held" in summary
    assert "no result file yet" in summary and "--results" in summary


def test_report_rejects_bad_inputs_with_one_line(tmp_path: Path, capsys):
    results = tmp_path / "results"
    results.mkdir()
    template = tmp_path / "t.md"
    template.write_text("<!-- summary -->\n<!-- result:allreduce -->\n")
    args = argparse.Namespace(results=str(results), template=str(template),
                              out=str(tmp_path / "p.md"), readme="none", check=False)
    assert report.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "missing: chaos" in err

    (results / "x.json").write_text('{"bench": "allreduce"}')
    with pytest.raises(ResultError, match="missing command, date, figures"):
        load_results(results)


def test_the_commands_are_registered_in_the_cli(monkeypatch):
    from moshray.jobs.cli import main

    monkeypatch.chdir(ROOT)
    assert main(["config", "table", "--check"]) == 0
    assert main(["bench", "report", "--check"]) == 0
