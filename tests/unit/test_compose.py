"""docker-compose.yml works as written: `docker compose up --wait` waits for every
service's health check, so each check must run a tool that exists inside the image it names.

Docker is not on the CI machines, so the file is checked statically: every service has a
health check; the check's program is one the image family ships (the table below, from the
images' own Dockerfiles); a shell form needs an image with a shell; the ports a check probes
are the ones the service opens. The plain ``nats`` image is the server binary on ``scratch``:
nothing but ``nats-server`` — the old check (``wget`` there) hung ``up --wait``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"

#: Programs on the PATH of each image family (name, variant) — Debian-based official images
#: have a POSIX shell and coreutils; Alpine ones BusyBox (sh, wget, nc); scratch ones only
#: their binary.
_DEBIAN = {"sh", "bash", "cat", "test"}
_BUSYBOX = {"sh", "wget", "nc", "cat", "test"}
IMAGE_TOOLS: dict[tuple[str, str], set[str]] = {
    ("postgres", "debian"): _DEBIAN | {"postgres", "pg_isready", "psql"},
    ("postgres", "alpine"): _BUSYBOX | {"postgres", "pg_isready", "psql"},
    ("redis", "debian"): _DEBIAN | {"redis-server", "redis-cli"},
    ("redis", "alpine"): _BUSYBOX | {"redis-server", "redis-cli"},
    # The official image's own check script (docs: "healthcheck.sh --connect").
    ("mariadb", "debian"): _DEBIAN | {"mariadbd", "mariadb", "healthcheck.sh"},
    ("nats", "scratch"): {"nats-server"},
    ("nats", "alpine"): _BUSYBOX | {"nats-server"},
    ("rabbitmq", "debian"): _DEBIAN | {"rabbitmq-server", "rabbitmqctl", "rabbitmq-diagnostics"},
    ("rabbitmq", "alpine"): _BUSYBOX | {"rabbitmq-server", "rabbitmqctl", "rabbitmq-diagnostics"},
    # apache/kafka is built on eclipse-temurin's Alpine JRE; Kafka's scripts in /opt/kafka/bin.
    ("kafka", "alpine"): _BUSYBOX
    | {"/opt/kafka/bin/kafka-server-start.sh", "/opt/kafka/bin/kafka-broker-api-versions.sh"},
}
SHELLS = {"sh", "bash"}


def family(image: str) -> tuple[str, str]:
    name, _, tag = image.partition(":")
    name = name.rsplit("/", 1)[-1]
    if "alpine" in tag or name == "kafka":
        return name, "alpine"
    return name, "scratch" if name == "nats" else "debian"


def program(test: list[str] | str) -> tuple[str, bool]:
    """The program a health check runs, and whether it needs a shell."""
    if isinstance(test, str):
        return test.split()[0], True
    kind, *rest = test
    if kind == "CMD":
        return rest[0], False
    if kind == "CMD-SHELL":
        return rest[0].split()[0], True
    raise AssertionError(f"unexpected health check form {kind!r}")


def services() -> dict[str, Any]:
    loaded = yaml.safe_load(COMPOSE.read_text())
    found: dict[str, Any] = loaded["services"]
    return found


def test_every_service_has_a_health_check_so_up_wait_can_wait() -> None:
    assert set(services()) == {"postgres", "mariadb", "redis", "nats", "rabbitmq", "kafka"}
    for name, service in services().items():
        check = service.get("healthcheck")
        assert check and check.get("test"), f"{name}: no health check"
        assert not check.get("disable"), name


@pytest.mark.parametrize("name", ["postgres", "mariadb", "redis", "nats", "rabbitmq", "kafka"])
def test_each_health_check_runs_a_program_its_image_has(name: str) -> None:
    service = services()[name]
    tools = IMAGE_TOOLS[family(service["image"])]
    tool, needs_shell = program(service["healthcheck"]["test"])
    assert tool in tools, f"{name}: {tool!r} is not in image {service['image']!r}"
    if needs_shell:
        assert SHELLS & tools, f"{name}: CMD-SHELL needs a shell in {service['image']!r}"


def test_the_checker_refuses_the_old_nats_check() -> None:
    # The check this file replaced: wget inside the scratch nats image.
    tools = IMAGE_TOOLS[family("nats:2.10")]
    tool, _ = program(["CMD", "wget", "-q", "-O-", "http://127.0.0.1:8222/healthz"])
    assert tool not in tools


def test_the_nats_check_probes_the_monitoring_port_the_server_opens() -> None:
    nats = services()["nats"]
    command = nats["command"]
    assert command[0] == "nats-server" and "-js" in command  # JetStream, which the check asks
    port = command[command.index("-m") + 1]
    url = next(a for a in nats["healthcheck"]["test"] if a.startswith("http"))
    assert re.match(rf"http://127\.0\.0\.1:{port}/healthz\?js-enabled-only=true$", url)


def test_the_services_listen_where_the_readme_and_tests_look() -> None:
    ports = {name: s["ports"] for name, s in services().items()}
    assert "127.0.0.1:5432:5432" in ports["postgres"]
    assert "127.0.0.1:6379:6379" in ports["redis"]
    assert "127.0.0.1:4222:4222" in ports["nats"]
    assert "127.0.0.1:5672:5672" in ports["rabbitmq"]
    assert "127.0.0.1:9092:9092" in ports["kafka"]
    readme = (ROOT / "README.md").read_text()
    assert "docker compose up --wait" in readme
