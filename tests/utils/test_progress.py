"""kvmeans.utils.progress: the one place that decides whether a tqdm bar is drawn."""
import io
import sys

import pytest

from kvmeans.utils import progress


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_no_bar_when_disabled_or_without_a_terminal(monkeypatch):
    assert progress.progress_bar(10, enabled=False) is None
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert progress.progress_bar(10, terminal=True) is None


def test_a_bar_on_a_terminal_and_lines_above_it(monkeypatch, capsys):
    pytest.importorskip("tqdm")
    err = _Terminal()
    monkeypatch.setattr(sys, "stderr", err)
    bar = progress.progress_bar(4, terminal=True, unit="run", desc="arms")
    bar.update(4)
    progress.write_line("a line")
    bar.close()
    assert "arms" in err.getvalue() and "4/4" in err.getvalue()
    assert capsys.readouterr().out == "a line\n"


def test_no_bar_without_tqdm(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)          # import fails as if not installed
    assert progress.progress_bar(3) is None
    progress.write_line("plain")
    assert capsys.readouterr().out == "plain\n"
