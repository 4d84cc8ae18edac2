"""The plugin host: discovery, the allow-list, failures, conflicts and misspelt hooks."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
import textwrap

import pytest

from core import hookimpl
from core.errors import PluginError
from core.plugins import load_plugins


class BackendPlugin:
    def __init__(self, name: str = "toy", **options) -> None:
        self.name, self.options = name, options

    @hookimpl
    def core_register_backends(self, register):
        register(self.name, "core.testing.fake:FakeBackend", **self.options)


def installed_entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group="core")}


def run_cli(*args: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    import os

    env = {**os.environ, **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "core.cli", *args], capture_output=True, text=True, env=env,
                          timeout=120)


def test_core_plugins_json_lists_every_installed_plugin_with_version_and_hooks():
    result = run_cli("plugins", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    listed = {p["name"]: p for p in report["plugins"]}
    for name, ep in installed_entry_points().items():
        assert listed[name]["version"] == ep.dist.version
        assert listed[name]["distribution"] == ep.dist.name
        assert listed[name]["hooks"] and all(h.startswith("core_") for h in listed[name]["hooks"])


def test_allow_list_empty_loads_nothing_and_names_select():
    assert load_plugins(allow="").info() == []
    some = next(iter(installed_entry_points()), None)
    if some is None:
        pytest.skip("no plugin is installed in this environment")
    assert [p.name for p in load_plugins(allow=some).info()] == [some]
    result = run_cli("plugins", "--json", env_extra={"CORE_PLUGINS": ""})
    assert json.loads(result.stdout)["plugins"] == []


def test_a_misspelt_hook_is_an_error_naming_plugin_and_hook():
    class Misspelt:
        @hookimpl
        def core_register_backend(self, register):  # missing "s"
            pass

    host = load_plugins(allow="")
    with pytest.raises(PluginError, match=r"'misspelt'.*core_register_backend'.*did you mean 'core_register_backends'"):
        host.register(Misspelt(), name="misspelt")
    assert host.info() == []


def test_wrong_hook_arguments_are_an_error():
    class WrongArgs:
        @hookimpl
        def core_register_backends(self, registrar):
            pass

    with pytest.raises(Exception, match="registrar"):
        load_plugins(allow="").register(WrongArgs(), name="wrong")


def test_a_plugin_that_fails_to_import_is_reported_and_skipped(tmp_path, monkeypatch):
    dist = tmp_path / "broken_core_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-core-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[core]\nbroken = broken_core_plugin_module\n")
    (tmp_path / "broken_core_plugin_module.py").write_text("raise ImportError('missing dependency: frobnicate')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    host = load_plugins(allow="broken")
    assert host.info() == []
    assert host.failures[0].name == "broken" and "frobnicate" in host.failures[0].error
    result = run_cli("plugins", env_extra={"PYTHONPATH": str(tmp_path), "CORE_PLUGINS": "broken"})
    assert result.returncode == 0 and "FAILED TO LOAD" in result.stdout and "frobnicate" in result.stdout


def test_two_plugins_registering_one_name_is_a_conflict_naming_both():
    host = load_plugins(allow="")
    host.register(BackendPlugin(), name="first")
    host.register(BackendPlugin(), name="second")
    with pytest.raises(PluginError, match="backend 'toy' is registered by both plugin 'first' and plugin 'second'"):
        _ = host.backends


def test_override_replaces_on_purpose():
    host = load_plugins(allow="")
    host.register(BackendPlugin(description="built-in"), name="first")
    host.register(BackendPlugin(override=True, description="mine"), name="second")
    assert host.backends.get("toy").plugin == "second"


def test_unknown_registration_options_are_rejected():
    host = load_plugins(allow="")
    host.register(BackendPlugin(colour="blue"), name="first")
    with pytest.raises(PluginError, match="colour"):
        _ = host.backends


def test_lazy_targets_that_cannot_load_say_so():
    host = load_plugins(allow="")

    class Lazy:
        @hookimpl
        def core_register_backends(self, register):
            register("ghost", "no_such_module_anywhere:Backend")

    host.register(Lazy(), name="lazy")
    with pytest.raises(PluginError, match="ghost.*no_such_module_anywhere"):
        host.backends.get("ghost").load()


def test_import_core_and_core_plugins_do_not_import_torch():
    code = textwrap.dedent("""
        import sys, core, core.cli
        assert 'torch' not in sys.modules
        core.cli.main(['plugins'])
        assert 'torch' not in sys.modules, 'core plugins imported torch'
        core.cli.build_parser().format_help()
        assert 'torch' not in sys.modules
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_core_help_runs():
    result = run_cli("--help")
    assert result.returncode == 0 and "serve" in result.stdout and "plugins" in result.stdout
