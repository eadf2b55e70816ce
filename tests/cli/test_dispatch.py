"""Sub-command dispatch of `kvmeans bench|data|eval`: help lists the choices, unknown names fail with 2."""
import pytest

from kvmeans.cli import main as cli
from kvmeans.cli.eval import TASKS


@pytest.mark.parametrize("cmd, noun, names", [("bench", "benchmark", ["ops"]), ("data", "action", ["prepare"]),
                                              ("eval", "task", list(TASKS))])
def test_help_and_unknown_names(cmd, noun, names, capsys):
    assert cli([cmd]) == 0 and cli([cmd, "--help"]) == 0
    out = capsys.readouterr().out
    assert f"usage: kvmeans {cmd} <{noun}>" in out and all(f"  {n} " in out for n in names)
    assert cli([cmd, "nope"]) == 2
    assert f"kvmeans {cmd}: unknown {noun} 'nope'; available: {', '.join(names)}" in capsys.readouterr().err


@pytest.mark.parametrize("argv, prog", [(["bench", "ops", "--help"], "kvmeans bench ops"),
                                         (["eval", "memory", "--help"], "kvmeans eval memory")])
def test_dispatch_reaches_the_module(argv, prog, capsys):
    with pytest.raises(SystemExit) as exit_:          # the module's own argparse answers --help
        cli(argv)
    assert exit_.value.code == 0 and prog in capsys.readouterr().out
