"""The generated references (docs/gen_ref.py) name every CLI command and option and every config field.

The pages are built from the code at every docs build; this checks them against the code from the
other side, walking the parser and the pydantic models here, so a generator that skips something
(a new subcommand, a config class left out of CONFIG_MODULES) fails the suite, not only the site.
"""

from __future__ import annotations

import argparse
import importlib
import runpy
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

ROOT = Path(__file__).resolve().parents[1]
GEN = runpy.run_path(str(ROOT / "docs" / "gen_ref.py"), run_name="gen_ref")


def _commands(parser: argparse.ArgumentParser, path: list[str]) -> list[tuple[str, list[str]]]:
    """(command path, its option strings and positional names) for every subcommand, depth first."""
    found = []
    for sub in (a for a in parser._actions if isinstance(a, argparse._SubParsersAction)):
        for name, child in sub.choices.items():
            full = path + [name]
            args = [s for a in child._actions if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))
                    for s in (a.option_strings or [a.dest])]
            found.append((" ".join(full), args))
            found += _commands(child, full)
    return found


def test_every_cli_command_and_option_is_in_the_cli_reference():
    from needle_flows.cli import add_data, add_finetune
    from needle.cli import build_parser

    page = GEN["cli_page"]()
    commands = _commands(build_parser(extensions=[add_finetune, add_data]), ["needle"])
    assert {"needle finetune", "needle serve", "needle data add"} <= {c for c, _ in commands}
    for command, args in commands:
        assert f"## `{command}`" in page, f"{command} missing from the CLI reference"
        section = page.split(f"## `{command}`", 1)[1].split("\n## ", 1)[0]
        for arg in args:
            assert f"`{arg}" in section or arg in section, f"{command} {arg} missing from the CLI reference"


def _models(module_name: str) -> dict[str, Any]:
    module = importlib.import_module(module_name)
    return {n: v for n, v in vars(module).items() if isinstance(v, type) and issubclass(v, BaseModel)
            and v.__module__ == module_name and not n.startswith("_")}


def test_every_config_field_is_in_the_configuration_reference():
    page = GEN["config_page"]()
    n = 0
    for module_name in GEN["CONFIG_MODULES"]:
        for name, cls in _models(module_name).items():
            assert f"### {name}" in page, f"{module_name}.{name} missing from the configuration reference"
            section = page.split(f"### {name}\n", 1)[1].split("\n### ", 1)[0]
            for field in cls.model_fields:
                assert f"| `{field}` |" in section, f"{module_name}.{name}.{field} missing from the reference"
                n += 1
    assert "needle.config" in GEN["CONFIG_MODULES"] and n > 50


def test_a_config_class_left_out_of_the_generator_fails_the_build(monkeypatch):
    # gen_ref refuses a module whose pydantic models it does not all list, rather than skip one.
    modules = {k: list(v) for k, v in GEN["CONFIG_MODULES"].items()}
    modules["needle.config"].remove("EvalConfig")
    monkeypatch.setitem(GEN["config_page"].__globals__, "CONFIG_MODULES", modules)
    with pytest.raises(GEN["ReferenceError"], match=r"EvalConfig.*CONFIG_MODULES"):
        GEN["config_page"]()
