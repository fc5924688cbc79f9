"""Progress: a bar per output file on a terminal, silence otherwise or with --quiet, --log-json lines."""
from __future__ import annotations

import json
import sys

import pytest
from gguf import GGUFReader

import convert_kimi_k3

SPLIT = ("--split-max-tensors", "150")


def _run(capsys, monkeypatch, k3_tiny_dir, tmp_path, *flags: str, tty: bool) -> str:
    monkeypatch.setattr(sys.stderr, "isatty", lambda: tty)
    assert convert_kimi_k3.main([str(k3_tiny_dir), str(tmp_path / "k3.gguf"), *SPLIT, *flags]) == 0
    return capsys.readouterr().err


def test_a_bar_per_file_on_a_terminal(capsys, monkeypatch, k3_tiny_dir, tmp_path):
    err = _run(capsys, monkeypatch, k3_tiny_dir, tmp_path, tty=True)
    parts = sorted(p.name for p in tmp_path.glob("k3-*-of-*.gguf"))
    assert len(parts) == 3
    for name in parts:
        last = [line for line in err.replace("\r", "\n").splitlines() if line.startswith(name)][-1]
        assert "100%" in last and "B/s" in last, last  # throughput; tqdm shows the ETA while running


@pytest.mark.parametrize("flags, tty", [(("--quiet",), True), ((), False)], ids=["quiet", "not-a-tty"])
def test_no_bar_when_quiet_or_not_a_terminal(capsys, monkeypatch, k3_tiny_dir, tmp_path, flags, tty):
    assert _run(capsys, monkeypatch, k3_tiny_dir, tmp_path, *flags, tty=tty) == ""


def test_log_json_has_a_line_per_tensor(capsys, monkeypatch, k3_tiny_dir, tmp_path):
    log = tmp_path / "progress.jsonl"
    _run(capsys, monkeypatch, k3_tiny_dir, tmp_path, "--quiet", "--log-json", str(log), tty=False)
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    parts = sorted(tmp_path.glob("k3-*-of-*.gguf"))
    expected = [(p.name, t.name, int(t.n_bytes)) for p in parts for t in GGUFReader(p).tensors]
    assert [(x["file"], x["tensor"]) for x in lines] == [e[:2] for e in expected]
    total = sum(n for _, _, n in expected)
    done = 0
    for x, (name, _, n) in zip(lines, expected):
        done += n
        assert x["bytes_done"] == done and x["bytes_total"] == total
        assert x["file_bytes_total"] == sum(m for f, _, m in expected if f == name)
        assert 0 <= x["file_bytes_done"] <= x["file_bytes_total"] and x["rate_bytes_per_s"] >= 0
    assert [x["elapsed_s"] for x in lines] == sorted(x["elapsed_s"] for x in lines)
    finals = [x for i, x in enumerate(lines) if i + 1 == len(lines) or lines[i + 1]["file"] != x["file"]]
    assert [x["file"] for x in finals] == [p.name for p in parts]
    assert all(x["file_bytes_done"] == x["file_bytes_total"] for x in finals)


def test_log_json_in_a_missing_directory_is_refused(capsys, k3_tiny_dir, tmp_path):
    rc = convert_kimi_k3.main([str(k3_tiny_dir), str(tmp_path / "k3.gguf"), "--quiet",
                               "--log-json", str(tmp_path / "nope" / "p.jsonl")])
    err = capsys.readouterr().err
    assert rc == 1 and "p.jsonl: cannot write the JSON progress log" in err
