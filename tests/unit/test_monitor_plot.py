"""`idlegrad plot`: a metrics log to a PNG; bad input is one line."""

from __future__ import annotations

import builtins
import json

import pytest

from idlegrad.cli.main import main
from idlegrad.common.errors import ConfigError
from idlegrad.monitor.plot import load_metrics, pick_metric


def write_log(path, n=6, final=True):
    with open(path, "w") as fh:
        for i in range(n):
            rec = {"time": 1e9 + i, "elapsed": i * 0.5, "version": i * 10, "samples": i * 320,
                   "epoch": i * 0.2, "loss": 2.0 / (i + 1) if i else None,
                   "metrics": {"loss": 2.0 / (i + 1), "accuracy": 0.1 + 0.15 * i},
                   "workers": min(i, 3), "samples_per_s": 100.0 * i}
            if final and i == n - 1:
                rec.update(final=True, reason="target")
            fh.write(json.dumps(rec) + "\n")
    return path


def test_plot_writes_a_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "run.png"
    assert main(["plot", str(write_log(tmp_path / "m.jsonl")), "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    assert f"wrote {out}" in capsys.readouterr().out


def test_plot_without_matplotlib_says_which_extra(tmp_path, capsys, monkeypatch):
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    assert main(["plot", str(write_log(tmp_path / "m.jsonl")), "-o", str(tmp_path / "x.png")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "idlegrad[plot]" in err[0]
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize("content,message", [
    ("", "no metrics records"), ("not json\n", "is not JSON"), ("[1, 2]\n", "not a metrics record"),
    ('{"version": 1}\n', "not a metrics record")])
def test_bad_logs_are_one_line(tmp_path, capsys, content, message):
    path = tmp_path / "m.jsonl"
    path.write_text(content)
    with pytest.raises(ConfigError, match=message):
        load_metrics(str(path))
    assert main(["plot", str(path), "-o", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_missing_file_and_unknown_metric(tmp_path, capsys):
    assert main(["plot", str(tmp_path / "nope.jsonl")]) == 2
    assert "cannot read" in capsys.readouterr().err
    records = load_metrics(str(write_log(tmp_path / "m.jsonl")))
    assert pick_metric(records) == "accuracy"
    assert pick_metric(records, "loss") == "loss"
    with pytest.raises(ConfigError, match="f1"):
        pick_metric(records, "f1")
