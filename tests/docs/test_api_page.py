"""docs/app/api.md agrees with the code: every public signature it shows is the one the
code has (rendered here from ``inspect.signature``), every member of the handler's
contexts is in its tables, and its command list is the app's commands with their options.

A parameter added to or removed from ``jobs.request`` (or any function below) fails
``test_api_page__signatures_match_the_code`` with the signature to paste."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import re
from pathlib import Path

import pytest
from django.core.management import get_commands, load_command_class
from django.core.management.base import BaseCommand

import jobs

API_PAGE = Path(__file__).resolve().parents[2] / "docs" / "app" / "api.md"
# The public callables whose signatures the page shows, as ``jobs.<name>(...)``.
SIGNATURES = [
    "kind",
    "request",
    "request_many",
    "cancel",
    "then",
    "group",
    "result",
    "register_kind",
    "register_provider",
    "register_subject",
    "EffectSpec",
    "JobRequest",
]
CONTEXTS = {"JobContext": jobs.JobContext, "AsyncJobContext": jobs.AsyncJobContext}
# The reusable app's commands (the drills' ``burst``/``fake_provider`` are named in prose).
COMMAND_APPS = ("jobs",)


def _default(obj: object, param: inspect.Parameter) -> str:
    default = param.default
    if dataclasses.is_dataclass(obj) and repr(default) == "<factory>":
        [spec] = [f for f in dataclasses.fields(obj) if f.name == param.name]
        default = spec.default_factory()
    if isinstance(default, str):
        return json.dumps(default)  # the page quotes strings with "
    return repr(default)


def render(name: str, obj: object | None = None) -> str:
    """``jobs.name(a, b, *, c=1)``: names and defaults, as the page shows a signature."""
    obj = getattr(jobs, name) if obj is None else obj
    parts, star = [], False
    for param in inspect.signature(obj).parameters.values():
        if param.kind is param.VAR_POSITIONAL:
            parts.append(f"*{param.name}")
            star = True
            continue
        if param.kind is param.KEYWORD_ONLY and not star:
            parts.append("*")
            star = True
        text = param.name if param.kind is not param.VAR_KEYWORD else f"**{param.name}"
        if param.default is not param.empty:
            text += f"={_default(obj, param)}"
        parts.append(text)
    return f"jobs.{name}({', '.join(parts)})"


def _squeezed(text: str) -> str:
    return re.sub(r"\s+", "", text)


def _code(page: str) -> str:
    return "\n".join(re.findall(r"```python\n(.*?)```", page, re.S))


def signature_mismatches(page: str, functions: dict[str, object]) -> list[str]:
    """What the page does not show as the code has it: the signatures to paste."""
    code = _squeezed(_code(page))
    return [
        render(name, obj)
        for name, obj in functions.items()
        if _squeezed(render(name, obj)) not in code
    ]


def test_api_page__signatures_match_the_code():
    page = API_PAGE.read_text()
    missing = signature_mismatches(page, {name: getattr(jobs, name) for name in SIGNATURES})
    assert missing == [], "api.md's python blocks should show:\n" + "\n".join(missing)


def test_api_page__a_removed_parameter_is_caught():
    """What the test above does when ``jobs.request`` loses ``queue``."""
    real = jobs.request
    signature = inspect.signature(real)
    trimmed = [p for p in signature.parameters.values() if p.name != "queue"]

    def request(*args, **kwargs):
        return real(*args, **kwargs)

    request.__signature__ = signature.replace(parameters=trimmed)
    missing = signature_mismatches(API_PAGE.read_text(), {"request": request})
    assert missing == [render("request", request)]
    assert "queue" not in missing[0] and "priority=None" in missing[0]


@pytest.mark.parametrize("name", sorted(CONTEXTS))
def test_api_page__every_context_member_is_in_its_table(name):
    """Each public method and property of the context appears as `ctx.<member>` (or
    `await ctx.<member>`) in the table that follows the context's name on the page."""
    page = API_PAGE.read_text()
    table = page.split(f"`{name}` (", 1)[1].split("\n\n", 2)[1]
    members = sorted(m for m, _ in inspect.getmembers(CONTEXTS[name]) if not m.startswith("_"))
    missing = [m for m in members if not re.search(rf"`(await )?ctx\.{m}\b", table)]
    assert missing == [], f"api.md's {name} table names no `ctx.<member>` for {missing}"


def _options(parser: argparse.ArgumentParser, base: set[str]) -> tuple[set[str], set[str]]:
    """A command's own long options and subcommands (Django's common ones left out)."""
    options, subcommands = set(), set()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                subcommands.add(name)
                more, deeper = _options(sub, base)
                options |= more
                subcommands |= deeper
        elif action.help != argparse.SUPPRESS:
            options |= {o for o in action.option_strings if o.startswith("--")} - base
    return options, subcommands


def app_commands() -> dict[str, tuple[set[str], set[str]]]:
    base_parser = BaseCommand().create_parser("manage.py", "base")
    base = {o for a in base_parser._actions for o in a.option_strings}
    found = {}
    for name, app in get_commands().items():
        if app in COMMAND_APPS:
            parser = load_command_class(app, name).create_parser("manage.py", name)
            found[name] = _options(parser, base)
    return found


def test_api_page__the_command_table_lists_each_command_with_its_options():
    section = API_PAGE.read_text().split("## Commands", 1)[1].split("\n## ", 1)[0]
    rows = {m[1]: m[0] for m in re.finditer(r"^\| `(\w+)[^|]*\|.*$", section, re.M)}
    commands = app_commands()
    assert sorted(rows) == sorted(commands), "api.md's command table vs the code's commands"
    for name, (options, subcommands) in commands.items():
        for word in sorted(options | subcommands):
            assert re.search(rf"`[^`]*{re.escape(word)}\b", rows[name]), (
                f"api.md's row for {name} does not name {word}"
            )
