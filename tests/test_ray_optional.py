"""Ray is an optional extra: without it `import core`, `core --help` and `core serve` never import it, and
`core serve --replicas` says what to install. Runs with or without ray installed (it hides ray)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from core.cli import main

INSTALL_HINT = "pip install 'core-serve[ray]'"


def test_import_core_and_its_help_do_not_import_ray():
    code = textwrap.dedent("""
        import sys, core, core.cli
        core.cli.build_parser().format_help()
        core.cli.build_parser().parse_args(['serve', '--replicas', '2']).run
        loaded = sorted(m for m in sys.modules if m == 'ray' or m.startswith(('ray.', 'core.ray')))
        assert not loaded, loaded
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


@pytest.fixture
def without_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    """`import ray` fails in this process as if ray were not installed (and core.ray is imported afresh)."""
    for name in [m for m in sys.modules if m == "ray" or m.startswith(("ray.", "core.ray"))]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "ray", None)


def test_replicas_without_ray_is_an_error_saying_what_to_install(without_ray, capsys):
    assert main(["serve", "--replicas", "2"]) == 2
    err = capsys.readouterr().err
    assert "--replicas needs Ray Serve" in err and INSTALL_HINT in err


@pytest.mark.parametrize("flags", [["--ray-address", "auto"], ["--replica-gpus", "1"], ["--replica-cpus", "2"]])
def test_ray_flags_without_replicas_are_refused(flags, capsys):
    with pytest.raises(SystemExit, match="needs --replicas"):
        main(["serve", *flags])


@pytest.mark.parametrize("value", ["0", "-1", "two"])
def test_replicas_must_be_a_positive_whole_number(value, capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--replicas", value])
    assert "argument --replicas" in capsys.readouterr().err
