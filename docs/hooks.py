"""MkDocs hooks (``hooks:`` in mkdocs.yml): reference pages generated from the code at build
time, so they cannot drift from it.

A page asks for a generated block with an HTML comment on a line of its own:

- ``<!-- generated: settings -->``: every ``OutboxSettings`` field, its environment
  variable, type, default, bounds and description, in a table per settings group; the
  build fails (a warning under ``--strict``) when a field is missing from the page's
  hand-written table;
- ``<!-- generated: cli -->``: every ``fastapi-outbox`` command's help, from its parser;
- ``<!-- generated: metrics -->``: the Prometheus metrics ``PrometheusInstrumentation``
  registers, with their type, labels and help.
"""

from __future__ import annotations

import argparse
import logging
import re
from typing import Any

log = logging.getLogger("mkdocs.hooks.generated")

MARKER = re.compile(r"^<!-- generated: (\w+) -->$", re.MULTILINE)


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _type_name(annotation: Any) -> str:
    text = getattr(annotation, "__name__", None) if isinstance(annotation, type) else None
    text = text or str(annotation)
    return re.sub(r"\b(typing|collections\.abc|datetime)\.", "", text).replace("NoneType", "None")


def _bounds(metadata: list[Any]) -> str:
    symbols = {"ge": "≥", "gt": ">", "le": "≤", "lt": "<"}
    out = []
    for item in metadata:
        for attr, symbol in symbols.items():
            value = getattr(item, attr, None)
            if value is not None:
                out.append(f"{symbol} {value}")
    return ", ".join(out)


def settings_table(markdown: str) -> str:
    """One table per settings group (``SETTING_GROUPS``, in its order), each field with its
    environment variable, type, default, bounds and description."""
    from pydantic_core import PydanticUndefined

    from fastapi_outbox import OutboxSettings
    from fastapi_outbox.settings import SETTING_GROUPS, setting_group

    prefix = OutboxSettings.model_config.get("env_prefix", "")
    hand_written = set(re.findall(r"`(\w+)`", markdown.split("<!-- generated")[0]))
    rows: dict[str, list[str]] = {key: [] for key in SETTING_GROUPS}
    for name, field in OutboxSettings.model_fields.items():
        if name not in hand_written:
            log.warning("settings page: OutboxSettings.%s is not in the hand-written table", name)
        if field.default_factory is not None:
            default = "(computed)"
        elif field.default is PydanticUndefined or field.default is None:
            default = "\N{EN DASH}"
        else:
            default = f"`{field.default!r}`"
        rows[setting_group(name)].append(
            f"| `{name}` | `{prefix}{name.upper()}` | `{_cell(_type_name(field.annotation))}` "
            f"| {_cell(default)} | {_cell(_bounds(field.metadata))} "
            f"| {_cell(field.description or '')} |"
        )
    parts = []
    for key, (title, about) in SETTING_GROUPS.items():
        parts += [
            f"### {title} {{ #fields-{key} }}",
            "",
            about,
            "",
            "| field | environment | type | default | bounds | description |",
            "|---|---|---|---|---|---|",
            *rows[key],
            "",
        ]
    return "\n".join(parts)


def _commands(
    parser: argparse.ArgumentParser, path: list[str]
) -> list[tuple[list[str], argparse.ArgumentParser]]:
    out = [(path, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out += _commands(sub, [*path, name])
    return out


def cli_reference() -> str:
    import os

    from fastapi_outbox.cli import build_parser

    os.environ.setdefault("COLUMNS", "100")  # argparse wraps its help to the terminal
    parser = build_parser()
    parts = []
    for path, sub in _commands(parser, ["fastapi-outbox"]):
        title = " ".join(path)
        level = "##" if len(path) <= 2 else "###"
        parts.append(f"{level} `{title}`\n\n```text\n{sub.format_help().rstrip()}\n```\n")
    return "\n".join(parts)


def metrics_table() -> str:
    from prometheus_client import CollectorRegistry

    from fastapi_outbox.ops.metrics import PrometheusInstrumentation

    instrumentation = PrometheusInstrumentation(CollectorRegistry(), tracing=False)
    rows = ["| metric | type | labels | help |", "|---|---|---|---|"]
    for collector in vars(instrumentation.metrics).values():
        describe = getattr(collector, "describe", None)
        if describe is None:
            continue
        labels = ", ".join(f"`{n}`" for n in getattr(collector, "_labelnames", ()))
        for family in describe():
            suffix = "_total" if family.type == "counter" else ""
            rows.append(
                f"| `{family.name}{suffix}` | {family.type} | {labels} "
                f"| {_cell(family.documentation)} |"
            )
    return "\n".join(rows)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    def generate(match: re.Match[str]) -> str:
        kind = match.group(1)
        if kind == "settings":
            return settings_table(markdown)
        if kind == "cli":
            return cli_reference()
        if kind == "metrics":
            return metrics_table()
        log.warning("%s: unknown generated block %r", page.file.src_path, kind)
        return match.group(0)

    return MARKER.sub(generate, markdown)


#: A Sphinx role left in a docstring: mkdocstrings renders it as the raw text
#: ``:class:<code>Outbox</code>``. Docstrings cross-reference with autorefs instead:
#: ``[`Outbox`][fastapi_outbox.Outbox]``, or plain backticks for an internal name.
RAW_ROLE = re.compile(r":(?:mod|meth|class|func|attr|data|exc|obj):(?=<code>|`)")


def on_page_content(html: str, page: Any, config: Any, files: Any) -> str:
    """Fail the strict build when a page shows a raw Sphinx role."""
    found = RAW_ROLE.findall(html)
    if found:
        log.warning(
            "%s shows %d raw Sphinx role(s) (%s): write [`Name`][fastapi_outbox.Name] in the "
            "docstring instead",
            page.file.src_path,
            len(found),
            ", ".join(sorted(set(found))),
        )
    return html
