"""nox sessions: tests, lint, typecheck, docs, bench. ``nox -s tests`` etc."""

from __future__ import annotations

import nox

nox.options.sessions = ["lint", "typecheck", "tests"]
nox.options.reuse_existing_virtualenvs = True


@nox.session
def tests(session: nox.Session) -> None:
    session.install("-e", ".[test]")
    session.run("pytest", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    session.install("ruff>=0.17", "import-linter>=2.17")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    # The house's layers ([tool.importlinter] in pyproject.toml); it reads the source from
    # the working directory, so the package need not be installed here.
    session.run("lint-imports")


@nox.session
def typecheck(session: nox.Session) -> None:
    session.install("-e", ".[test]")
    session.run("mypy", "fastapi_outbox")


@nox.session
def docs(session: nox.Session) -> None:
    """Build the documentation site into site/ with --strict (a broken link, reference or
    generated table fails); ``nox -s docs -- serve`` serves it on 127.0.0.1:8000 instead."""
    session.install("-e", ".[docs]")
    env = {"NO_MKDOCS_2_WARNING": "1"}
    if session.posargs[:1] == ["serve"]:
        session.run("mkdocs", "serve", "--strict", env=env)
    else:
        session.run("mkdocs", "build", "--strict", env=env)


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmarks on the local services; pass a script name to run only that one."""
    session.install("-e", ".[test]", "py-spy")  # py-spy: hot spots when a goal is missed
    scripts = session.posargs or [
        "write_path",
        "dispatch",
        "health",
        "ordered_claim",
        "dashboard",
        "scale",
        "wal",
        "consume",
    ]
    for script in scripts:
        session.run("python", f"benchmarks/{script}.py")


@nox.session
def screenshots(session: nox.Session) -> None:
    """Regenerate the dashboard screenshots of the docs (needs: apt-get install chromium)."""
    session.install("-e", ".[test]")
    session.run("python", "docs/screenshots.py")
