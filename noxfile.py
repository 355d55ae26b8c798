"""nox sessions: tests, lint, typecheck, docs, bench. ``nox -s tests`` etc."""

from __future__ import annotations

import shutil

import nox

nox.options.sessions = ["lint", "typecheck", "tests"]
nox.options.reuse_existing_virtualenvs = True


#: The tested set of every dependency (what CI and the README's commands install).
CONSTRAINTS = ("-c", "constraints.txt")


@nox.session
def tests(session: nox.Session) -> None:
    session.install("-e", ".[test]", *CONSTRAINTS)
    # The official AsyncAPI parser the document is checked with (its tests skip without it).
    if shutil.which("npm"):
        session.run(
            "npm", "ci", "--ignore-scripts", "--no-audit", "--no-fund", "--prefix",
            "tools/asyncapi", external=True,
        )  # fmt: skip
    session.run("pytest", *session.posargs)


@nox.session
def newest(session: nox.Session) -> None:
    """The suite on the newest release of every dependency (no constraints): run it before
    ``nox -s lock`` moves the tested set forward, and whenever a client releases."""
    session.install("--upgrade", "--upgrade-strategy", "eager", "-e", ".[test]")
    session.run("pip", "list", "--format=freeze", silent=False)
    session.run("pytest", *session.posargs)


@nox.session
def lock(session: nox.Session) -> None:
    """Write constraints.txt from the newest releases (after ``nox -s newest`` passed)."""
    session.install("--upgrade", "--upgrade-strategy", "eager", "-e", ".[test,docs]")
    frozen = session.run("pip", "freeze", "--exclude-editable", silent=True) or ""
    header = (
        "# The tested set: what CI and the README's commands install (pip install -c "
        "constraints.txt).\n# Refresh with 'nox -s lock' after 'nox -s newest' passes on "
        "the newest releases.\n"
    )
    lines = [line for line in str(frozen).splitlines() if not line.startswith("fastapi")]
    with open("constraints.txt", "w") as out:
        out.write(header + "\n".join(lines) + "\n")


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
    session.install("-e", ".[test]", *CONSTRAINTS)
    session.run("mypy", "fastapi_outbox")


@nox.session
def docs(session: nox.Session) -> None:
    """Build the documentation site into site/ with --strict (a broken link, reference or
    generated table fails); ``nox -s docs -- serve`` serves it on 127.0.0.1:8000 instead."""
    session.install("-e", ".[docs]", *CONSTRAINTS)
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
        "producer",
        "write_path",
        "dispatch",
        "health",
        "ordered_claim",
        "dashboard",
        "scale",
        "wal",
        "consume",
        "e2e",
        "notify_lock",
    ]
    for script in scripts:
        session.run("python", f"benchmarks/{script}.py")


@nox.session
def perf(session: nox.Session) -> None:
    """The short ratio benchmarks (producer, drain, consume), each ratio printed against
    its floor; a few minutes. Arguments go to benchmarks/perf.py (``-- --only producer``)."""
    session.install("-e", ".[test]", *CONSTRAINTS)
    session.run("python", "benchmarks/perf.py", *session.posargs)


@nox.session
def screenshots(session: nox.Session) -> None:
    """Regenerate the dashboard screenshots of the docs (needs: apt-get install chromium)."""
    session.install("-e", ".[test]")
    session.run("python", "docs/screenshots.py")
