"""The `ubtree` command line: registry, convert-target, errors, console script."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

import ubtree_vllm
from ubtree_vllm import cli


def test_every_command_is_well_formed_and_gets_a_subparser():
    parser = cli.build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert set(subparsers.choices) == set(cli.COMMANDS)
    for name, command in cli.COMMANDS.items():
        assert isinstance(command, cli.Command)
        assert command.help.strip(), name
        assert callable(command.add_args) and callable(command.run)


def test_convert_target_prints_the_cached_folder(default_target_dir, capsys):
    assert cli.main(["convert-target"]) == 0
    assert Path(capsys.readouterr().out.strip()) == default_target_dir


def test_convert_target_bad_gguf_is_a_one_line_error(tmp_path, capsys):
    missing = tmp_path / "missing.gguf"
    status = cli.main(["convert-target", "--gguf", str(missing), "--cache-dir", str(tmp_path)])
    assert status == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("ubtree convert-target: error: ")
    assert str(missing) in captured.err
    assert "Traceback" not in captured.err


@pytest.mark.parametrize("argv", [["no-such-command"], []])
def test_unknown_or_missing_subcommand_is_an_argparse_error(argv, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    assert "usage: ubtree" in capsys.readouterr().err


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"ubtree {ubtree_vllm.__version__}"


def test_registered_command_runs_with_its_own_arguments(monkeypatch, capsys):
    seen = {}

    def add_args(parser):
        parser.add_argument("--n", type=int, default=1)

    def run(args):
        seen["n"] = args.n
        return 3

    monkeypatch.setitem(cli.COMMANDS, "toy", cli.Command("a toy command", add_args, run))
    assert cli.main(["toy", "--n", "5"]) == 3
    assert seen == {"n": 5}


def test_lazy_imports_only_when_run(monkeypatch):
    run = cli.lazy("json:dumps")
    assert run({"a": 1}) == '{"a": 1}'
    with pytest.raises(ValueError, match="package.module:function"):
        cli.lazy("json.dumps")


def test_console_script_is_installed():
    script = Path(sys.executable).parent / "ubtree"
    assert script.is_file(), f"{script} missing: is the package installed (pip install -e .)?"
    proc = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for name in cli.COMMANDS:
        assert name in proc.stdout
