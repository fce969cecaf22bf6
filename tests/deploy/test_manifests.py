"""The deployment files agree with each other and with the programs they start: deploy/Dockerfile,
deploy/docker-compose.yml and deploy/k8s/*.yaml are parsed (no Docker or cluster needed), every command is run
through its program's own argparse parser, and every port is followed from the command that binds it to the
health check, the exposed ports, the probes, the Services and the orchestrator's --services that name it."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pytest
import yaml

from services.common import healthcheck
from services.common.cli import MODEL_ENV
from tests.conftest import ROOT

DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
NETWORKS = ("perception", "llm", "tts", "codec")
MODULES = {name: f"services.{name}" for name in NETWORKS} | {"orchestrator": "orchestrator.cli"}
# The documented defaults: gRPC and metrics port of each process, and the orchestrator's realtime WebSocket.
GRPC_PORTS = {"perception": 50051, "llm": 50052, "tts": 50053, "codec": 50054, "orchestrator": 50060}
METRICS_PORTS = {"perception": 9101, "llm": 9102, "tts": 9103, "codec": 9104, "orchestrator": 9105}
REALTIME_PORT = 8080
MODEL_MOUNT = "/model"
MODEL_CLAIM = "voicechat-model"

_spec = importlib.util.spec_from_file_location("deploy_requirements", DEPLOY / "requirements.py")
deploy_requirements = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(deploy_requirements)
requirement_name, requirements = deploy_requirements.requirement_name, deploy_requirements.requirements


# ---------------------------------------------------------------------------------------------------------------
# Variables: compose's ${NAME:-default} and Kubernetes' $(NAME)

_COMPOSE_VARIABLE = re.compile(r"\$\$|\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?-)(?P<default>[^}]*))?\}")


def expand(text: str, env: Mapping[str, str] | None = None) -> str:
    """Compose's interpolation: `${NAME:-default}` is env[NAME] when set and not empty, else default;
    `${NAME-default}` is env[NAME] when set; `${NAME}` must be set; `$$` is a literal `$`."""
    env = env or {}

    def replace(match: re.Match) -> str:
        if match.group() == "$$":
            return "$"
        name, op, default = match.group("name", "op", "default")
        value = env.get(name)
        if op == ":-" and not value:
            return default
        if op == "-" and value is None:
            return default
        if value is None:
            raise KeyError(f"${{{name}}} has no default and is not set")
        return value

    return _COMPOSE_VARIABLE.sub(replace, text)


def expand_tree(value: Any, env: Mapping[str, str]) -> Any:
    """expand() applied to every string in a parsed YAML document (keys stay as written)."""
    if isinstance(value, str):
        return expand(value, env)
    if isinstance(value, list):
        return [expand_tree(item, env) for item in value]
    if isinstance(value, dict):
        return {key: expand_tree(item, env) for key, item in value.items()}
    return value


def test_expand():
    assert expand("${PORT:-50051}") == "50051"
    assert expand("${PORT:-50051}", {"PORT": "6000"}) == "6000"
    assert expand("${PORT:-50051}", {"PORT": ""}) == "50051"
    assert expand("${PORT-50051}", {"PORT": ""}) == ""
    assert expand("a=dns:///a:${A:-1},b=${B:-x y}$$", {"A": "7"}) == "a=dns:///a:7,b=x y$"
    assert expand("${DIR:-./model}:/model:ro") == "./model:/model:ro"
    with pytest.raises(KeyError, match="PORT"):
        expand("${PORT}")


def expand_k8s(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' expansion in command and args: `$(NAME)` of a variable the container defines, else as is."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group()), text)


# ---------------------------------------------------------------------------------------------------------------
# Commands, through the programs' own parsers


@dataclass
class Invocation:
    module: str
    args: argparse.Namespace
    metrics_port: int


def program_parser(module: str) -> argparse.ArgumentParser:
    """The argparse parser `python -m MODULE` parses its command line with."""
    if module not in MODULES.values():
        raise AssertionError(f"{module!r} is none of the programs this image runs: {sorted(MODULES.values())}")
    if module == "orchestrator.cli":
        from orchestrator.cli import build_parser

        assert 'if __name__ == "__main__":' in (ROOT / "orchestrator" / "cli.py").read_text()
        return build_parser()
    from services.common.cli import build_parser

    main = importlib.import_module(f"{module}.__main__")  # what `python -m services.NAME` runs
    parser = build_parser(module, "")
    if hasattr(main, "add_arguments"):
        main.add_arguments(parser)
    return parser


def parse_command(command: list[str]) -> Invocation:
    """`python -m MODULE FLAGS...` parsed the way MODULE parses it; every flag must be one MODULE accepts."""
    assert command[:2] == ["python", "-m"] and len(command) > 2, f"not `python -m MODULE ...`: {command}"
    module, argv = command[2], command[3:]
    args, unknown = program_parser(module).parse_known_args(argv)
    assert unknown == [], f"{module} does not accept {unknown}"
    assert args.metrics_port is not None, f"{module} is started without --metrics-port"
    metrics_port = args.metrics_port
    return Invocation(module, args, metrics_port)


def test_parse_command_rejects_unknown_flags():
    with pytest.raises(AssertionError, match="does not accept"):
        parse_command(["python", "-m", "services.llm", "--port", "1", "--prot", "2"])
    with pytest.raises(AssertionError, match="does not accept"):
        parse_command(["python", "-m", "services.tts", "--metrics-port", "9103", "--extra"])
    with pytest.raises(AssertionError, match="none of the programs"):
        parse_command(["python", "-m", "services.nope"])


def check_network_invocation(invocation: Invocation, name: str) -> None:
    assert invocation.module == MODULES[name]
    assert invocation.args.host == "0.0.0.0", f"{name} must bind all interfaces, not {invocation.args.host}"
    assert invocation.args.metrics_host == "0.0.0.0", f"{name}'s metrics default to loopback: a scraper needs more"


def check_orchestrator_invocation(invocation: Invocation) -> None:
    args = invocation.args
    assert invocation.module == "orchestrator.cli" and args.command == "serve"
    assert (args.host, args.realtime_host, args.metrics_host) == ("0.0.0.0", "0.0.0.0", "0.0.0.0")
    assert not args.no_realtime and not args.in_process


# ---------------------------------------------------------------------------------------------------------------
# docker compose

COMPOSE_TEXT = (DEPLOY / "docker-compose.yml").read_text()
COMPOSE_VARIABLES = sorted({m.group("name") for m in _COMPOSE_VARIABLE.finditer(COMPOSE_TEXT) if m.group("name")})
# Once with every default, once with every variable set to its own value: the files must follow the variables
# consistently (a port hard-coded where a variable belongs fails the second).
ENVIRONMENTS = {"defaults": {}, "overridden": {name: str(41000 + i) for i, name in enumerate(COMPOSE_VARIABLES)}}


def compose(env_name: str) -> dict:
    return expand_tree(yaml.safe_load(COMPOSE_TEXT), ENVIRONMENTS[env_name])


def compose_invocations(env_name: str) -> dict[str, Invocation]:
    return {name: parse_command(service["command"]) for name, service in compose(env_name)["services"].items()}


def published(service: dict) -> set[int]:
    """Container ports a compose service exposes to the compose network or publishes to the host."""
    ports = {int(str(p)) for p in service.get("expose", [])}
    for entry in service.get("ports", []):
        ports.add(int(entry["target"]) if isinstance(entry, dict) else int(str(entry).split(":")[-1].split("/")[0]))
    return ports


def test_compose_has_the_five_processes():
    assert set(compose("defaults")["services"]) == set(MODULES)


@pytest.mark.parametrize("env_name", ENVIRONMENTS)
def test_compose_commands_and_ports(env_name):
    invocations = compose_invocations(env_name)
    for name in NETWORKS:
        check_network_invocation(invocations[name], name)
    check_orchestrator_invocation(invocations["orchestrator"])
    if env_name == "defaults":
        assert {name: i.args.port for name, i in invocations.items()} == GRPC_PORTS
        assert {name: i.metrics_port for name, i in invocations.items()} == METRICS_PORTS
        assert invocations["orchestrator"].args.realtime_port == REALTIME_PORT
    else:  # every port follows its own variable
        ports = [i.args.port for i in invocations.values()] + [i.metrics_port for i in invocations.values()]
        assert len(set(ports)) == len(ports) and all(p >= 41000 for p in ports), ports


@pytest.mark.parametrize("env_name", ENVIRONMENTS)
def test_compose_healthchecks_ask_the_bound_port(env_name):
    services = compose(env_name)["services"]
    invocations = compose_invocations(env_name)
    for name, service in services.items():
        test = service["healthcheck"]["test"]
        assert test[:4] == ["CMD", "python", "-m", "services.common.healthcheck"], f"{name}: {test}"
        args = healthcheck.build_parser().parse_args(test[4:])
        bound = invocations[name].args.port
        assert args.address == f"127.0.0.1:{bound}", f"{name} binds {bound}; its health check asks {args.address}"
        assert args.service == ""


@pytest.mark.parametrize("env_name", ENVIRONMENTS)
def test_compose_exposes_every_port_a_process_binds(env_name):
    services = compose(env_name)["services"]
    for name, invocation in compose_invocations(env_name).items():
        wanted = {invocation.args.port, invocation.metrics_port}
        if name == "orchestrator":
            wanted.add(invocation.args.realtime_port)
        assert wanted <= published(services[name]), f"{name} binds {wanted}, exposes {published(services[name])}"
    for name in NETWORKS:  # published host ports would stop `--scale NAME=2`
        assert "ports" not in services[name], f"{name} publishes host ports"
    host_ports = {int(str(entry).split(":")[0]) for entry in services["orchestrator"]["ports"]}
    assert host_ports == published(services["orchestrator"])


@pytest.mark.parametrize("env_name", ENVIRONMENTS)
def test_compose_orchestrator_reaches_each_service_by_name_and_port(env_name):
    invocations = compose_invocations(env_name)
    addresses = invocations["orchestrator"].args.services
    assert addresses == {name: f"dns:///{name}:{invocations[name].args.port}" for name in NETWORKS}


def test_compose_orchestrator_waits_for_four_healthy_services():
    depends_on = compose("defaults")["services"]["orchestrator"]["depends_on"]
    assert depends_on == {name: {"condition": "service_healthy"} for name in NETWORKS}


def duration_s(text: str) -> float:
    """A compose duration such as "15s", "1m30s" or "500ms", in seconds."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", text)
    assert parts and "".join(n + u for n, u in parts) == text, f"not a duration: {text!r}"
    return sum(float(n) * units[u] for n, u in parts)


def test_compose_mounts_the_model_read_only_and_stops_gracefully():
    invocations = compose_invocations("defaults")
    for name, service in compose("defaults")["services"].items():
        mounts = [v for v in service["volumes"] if isinstance(v, dict) and v["target"] == MODEL_MOUNT]
        assert len(mounts) == 1 and mounts[0]["read_only"] is True, f"{name}: {service['volumes']}"
        assert mounts[0]["source"] == "./model"
        assert service["environment"][MODEL_ENV] == MODEL_MOUNT
        assert service["restart"] == "unless-stopped"
        # Docker's SIGKILL must not cut the drain short.
        assert duration_s(service["stop_grace_period"]) > invocations[name].args.drain_seconds
        assert service["build"] == {"context": "..", "dockerfile": "deploy/Dockerfile"}
    source = compose("overridden")["services"]["llm"]["volumes"][0]["source"]
    assert source == ENVIRONMENTS["overridden"]["VOICECHAT_MODEL_DIR"]


# ---------------------------------------------------------------------------------------------------------------
# Dockerfile


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    instructions, pending = [], ""
    for line in (DEPLOY / "Dockerfile").read_text().splitlines():
        if line.strip().startswith("#") or not line.strip():
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        keyword, _, rest = pending.strip().partition(" ")
        instructions.append((keyword.upper(), rest.strip()))
        pending = ""
    assert not pending, "the Dockerfile ends inside a continued line"
    return instructions


def build_args() -> dict[str, str]:
    args = {}
    for keyword, rest in dockerfile_instructions():
        if keyword == "ARG":
            name, _, default = rest.partition("=")
            args[name] = shlex.split(default)[0] if default else ""
    return args


def test_dockerfile_base_image_and_mlx_build():
    instructions = dockerfile_instructions()
    assert instructions[0] == ("ARG", "BASE_IMAGE=python:3.11-slim")
    assert [rest for keyword, rest in instructions if keyword == "FROM"] == ["${BASE_IMAGE}"]
    linux_mlx = [r for r in tomllib_dependencies() if requirement_name(r) == "mlx" and "linux" in r]
    assert len(linux_mlx) == 1
    assert build_args()["MLX_SPEC"] == linux_mlx[0].split(";")[0].strip()  # the CPU build pyproject pins
    runs = " ".join(rest for keyword, rest in instructions if keyword == "RUN")
    assert 'pip install "${MLX_SPEC}" -r requirements.txt' in runs
    assert "python requirements.py pyproject.toml > requirements.txt" in runs
    assert "pip install --no-deps ." in runs
    assert "libsndfile1" in build_args()["APT_PACKAGES"] and "${APT_PACKAGES}" in runs


def tomllib_dependencies() -> list[str]:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]


def test_image_requirements_are_pyprojects_without_mlx():
    listed = requirements(ROOT / "pyproject.toml")
    assert listed == [r for r in tomllib_dependencies() if not r.startswith("mlx")]
    assert "grpcio-health-checking>=1.85,<2" in listed and "soundfile>=0.12" in listed
    assert requirement_name("Foo_Bar.baz[x]>=1; sys_platform == 'linux'") == "foo-bar-baz"


def test_dockerfile_runs_as_a_non_root_user_with_the_model_at_slash_model():
    instructions = dockerfile_instructions()
    users = [rest for keyword, rest in instructions if keyword == "USER"]
    assert users == ["10001:10001"]
    useradd = next(rest for keyword, rest in instructions if keyword == "RUN" and "useradd" in rest)
    assert "--uid 10001" in useradd
    env = " ".join(rest for keyword, rest in instructions if keyword == "ENV")
    assert f"{MODEL_ENV}={MODEL_MOUNT}" in env.split()
    assert not any("model" in rest.lower() for keyword, rest in instructions if keyword in ("COPY", "ADD"))


def test_dockerfile_default_command_is_the_orchestrator_on_exposed_ports():
    instructions = dockerfile_instructions()
    assert not [keyword for keyword, _ in instructions if keyword == "ENTRYPOINT"]
    (cmd,) = [rest for keyword, rest in instructions if keyword == "CMD"]
    invocation = parse_command(json.loads(cmd))
    check_orchestrator_invocation(invocation)
    assert invocation.args.services is None  # the four services start as its children
    assert (invocation.args.port, invocation.args.realtime_port, invocation.metrics_port) == (
        GRPC_PORTS["orchestrator"], REALTIME_PORT, METRICS_PORTS["orchestrator"])
    (exposed,) = [rest for keyword, rest in instructions if keyword == "EXPOSE"]
    assert {int(p) for p in exposed.split()} == {*GRPC_PORTS.values(), *METRICS_PORTS.values(), REALTIME_PORT}


def test_dockerignore_keeps_environments_history_and_models_out():
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()}
    assert {".git", ".venv", ".ref", ".device", "tests", "model", "deploy/model", "**/__pycache__"} <= ignored
    for needed in ("pyproject.toml", "README.md", "deploy", "services", "orchestrator", "protos"):
        assert needed not in ignored


# ---------------------------------------------------------------------------------------------------------------
# Kubernetes


def k8s_documents() -> list[dict]:
    documents = []
    for path in sorted(K8S.glob("*.yaml")):
        documents += [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
    return documents


def k8s_object(kind: str, name: str) -> dict:
    found = [d for d in k8s_documents() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def kustomization() -> dict:
    return yaml.safe_load((K8S / "kustomization.yaml").read_text())


def container_of(deployment: dict) -> dict:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def container_env(container: dict, namespace: str) -> dict[str, str]:
    """The container's variables as Kubernetes sets them; the pod's namespace where the downward API gives it."""
    env = {}
    for variable in container.get("env", []):
        if "value" in variable:
            env[variable["name"]] = variable["value"]
        elif variable["valueFrom"].get("fieldRef", {}).get("fieldPath") == "metadata.namespace":
            env[variable["name"]] = namespace
    return env


def container_invocation(deployment: dict, namespace: str) -> Invocation:
    container = container_of(deployment)
    env = container_env(container, namespace)
    command = [expand_k8s(part, env) for part in container["command"] + container.get("args", [])]
    return parse_command(command)


def container_port(container: dict, name: str) -> int:
    (port,) = [p["containerPort"] for p in container["ports"] if p["name"] == name]
    return port


def service_port(service: dict, name: str, container: dict) -> tuple[int, int]:
    """(port, the container port it forwards to) of the Service's port called `name`."""
    (entry,) = [p for p in service["spec"]["ports"] if p["name"] == name]
    target = entry.get("targetPort", entry["port"])
    return entry["port"], container_port(container, target) if isinstance(target, str) else target


def test_kustomization_lists_every_manifest():
    listed = kustomization()["resources"]
    assert sorted(listed) == sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
    namespace = kustomization()["namespace"]
    assert k8s_object("Namespace", namespace)
    images = {image["name"] for image in kustomization()["images"]}
    for doc in k8s_documents():
        if doc["kind"] == "Deployment":
            assert container_of(doc)["image"].split(":")[0] in images


def test_model_claim_is_shared_read_only():
    claim = k8s_object("PersistentVolumeClaim", MODEL_CLAIM)
    assert claim["spec"]["accessModes"] == ["ReadOnlyMany"]


@pytest.mark.parametrize("name", [*NETWORKS, "orchestrator"])
def test_k8s_deployment(name):
    namespace = kustomization()["namespace"]
    deployment = k8s_object("Deployment", name)
    service = k8s_object("Service", name)
    container = container_of(deployment)
    pod = deployment["spec"]["template"]
    invocation = container_invocation(deployment, namespace)
    if name == "orchestrator":
        check_orchestrator_invocation(invocation)
        assert service["spec"].get("clusterIP") != "None" and service["spec"].get("type", "ClusterIP") == "ClusterIP"
        assert service_port(service, "realtime", container) == (REALTIME_PORT, invocation.args.realtime_port)
    else:
        check_network_invocation(invocation, name)
        assert service["spec"]["clusterIP"] == "None", f"{name}'s Service must be headless"
    grpc_port = invocation.args.port
    assert (grpc_port, invocation.metrics_port) == (GRPC_PORTS[name], METRICS_PORTS[name])

    labels = deployment["spec"]["selector"]["matchLabels"]
    assert labels.items() <= pod["metadata"]["labels"].items()
    assert service["spec"]["selector"] == labels
    assert sum(1 for d in k8s_documents() if d["kind"] == "Deployment"
               and labels.items() <= d["spec"]["template"]["metadata"]["labels"].items()) == 1

    assert container_port(container, "grpc") == grpc_port
    assert service_port(service, "grpc", container) == (grpc_port, grpc_port)
    assert container_port(container, "metrics") == invocation.metrics_port
    assert service_port(service, "metrics", container) == (invocation.metrics_port, invocation.metrics_port)
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(invocation.metrics_port)
    assert annotations["prometheus.io/path"] == "/metrics"

    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"] == {"port": grpc_port}, f"{name} {probe}: {container[probe]}"

    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == MODEL_MOUNT]
    assert mount["readOnly"] is True
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == mount["name"]]
    assert volume["persistentVolumeClaim"] == {"claimName": MODEL_CLAIM, "readOnly": True}
    assert container_env(container, namespace)[MODEL_ENV] == MODEL_MOUNT

    requests = container["resources"]["requests"]
    assert set(requests) >= {"cpu", "memory"}
    assert pod["spec"]["terminationGracePeriodSeconds"] > invocation.args.drain_seconds
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True


def test_k8s_orchestrator_reaches_each_headless_service_and_port():
    namespace = kustomization()["namespace"]
    deployment = k8s_object("Deployment", "orchestrator")
    addresses = container_invocation(deployment, namespace).args.services
    expected = {}
    for name in NETWORKS:
        service = k8s_object("Service", name)
        port, _ = service_port(service, "grpc", container_of(k8s_object("Deployment", name)))
        expected[name] = f"dns:///{service['metadata']['name']}.{namespace}.svc.cluster.local:{port}"
    assert addresses == expected
    # The namespace comes from the pod itself, so the kustomization's namespace can change alone.
    env = container_of(deployment)["env"]
    (pod_namespace,) = [v for v in env if v["name"] == "POD_NAMESPACE"]
    assert pod_namespace["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
