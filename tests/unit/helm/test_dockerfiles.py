"""The images the chart runs (Dockerfile, Dockerfile.cuda; not built here:
no container engine on these machines) agree with the project and the chart."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest

from tests.unit.helm.chart import FULLNAME, container, find, pod_spec, render

ROOT = Path(__file__).resolve().parents[3]
DOCKERFILES = ["Dockerfile", "Dockerfile.cuda"]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _instructions(name: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", (ROOT / name).read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def _all(name: str, instruction: str) -> list[str]:
    return [rest for word, rest in _instructions(name) if word == instruction]


@pytest.mark.parametrize("name", DOCKERFILES)
def test_torch_is_installed_first_at_the_projects_pin(name: str) -> None:
    (pin,) = [d for d in PYPROJECT["project"]["dependencies"] if d.startswith("torch")]
    runs = _all(name, "RUN")
    torch_runs = [i for i, r in enumerate(runs) if "pip install torch" in r]
    assert torch_runs, f"{name} installs no torch"
    assert f"pip install {pin} --index-url" in runs[torch_runs[0]]
    project = next(i for i, r in enumerate(runs) if "pip install ." in r)
    assert torch_runs[0] < project


def test_the_cpu_image_uses_the_cpu_torch_on_python_311() -> None:
    (base,) = _all("Dockerfile", "FROM")
    assert base == "python:3.11-slim"
    assert PYPROJECT["project"]["requires-python"] == ">=3.11"
    assert "--index-url https://download.pytorch.org/whl/cpu" in " ".join(_all("Dockerfile", "RUN"))


def test_the_cuda_image_has_a_cuda_torch_and_nixl() -> None:
    args = dict(a.split("=", 1) for a in _all("Dockerfile.cuda", "ARG"))
    assert args["CUDA_IMAGE"].startswith("nvidia/cuda:12.")
    assert "-runtime-" in args["CUDA_IMAGE"]
    assert re.fullmatch(r"https://download\.pytorch\.org/whl/cu12\d", args["TORCH_INDEX_URL"])
    assert _all("Dockerfile.cuda", "FROM") == ["${CUDA_IMAGE}"]
    assert "nixl-cu12" in " ".join(_all("Dockerfile.cuda", "RUN"))


@pytest.mark.parametrize("name", DOCKERFILES)
def test_the_image_holds_every_package_and_runs_tandem(name: str) -> None:
    copied = {c.split()[0] for c in _all(name, "COPY")}
    packages = {
        p.split(".")[0] for p in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]
    }
    # Every top-level package, the protos its stubs are generated from, and
    # what setuptools reads (the readme is pyproject's).
    assert packages | {"protos", "pyproject.toml"} <= copied
    assert PYPROJECT["project"]["readme"] in " ".join(_all(name, "COPY"))
    for path in copied:
        assert (ROOT / path).exists(), path
    assert "python -m service.protogen" in " ".join(_all(name, "RUN"))
    (entrypoint,) = _all(name, "ENTRYPOINT")
    assert json.loads(entrypoint) == ["tandem"]
    assert PYPROJECT["project"]["scripts"]["tandem"] == "service.cli:main"
    # The chart's command is the same program.
    objects = render()
    for pool in ("prefill", "decode", "router"):
        assert container(find(objects, "Deployment", f"{FULLNAME}-{pool}"))["command"] == ["tandem"]


@pytest.mark.parametrize("name", DOCKERFILES)
def test_the_images_user_and_home_are_the_charts(name: str) -> None:
    (user,) = _all(name, "USER")
    uid, _, gid = user.partition(":")
    objects = render()
    deployment = find(objects, "Deployment", f"{FULLNAME}-decode")
    security = pod_spec(deployment)["securityContext"]
    assert (int(uid), int(gid)) == (security["runAsUser"], security["runAsGroup"])
    home = next(e.split("=", 1)[1] for e in _all(name, "ENV") if e.startswith("HOME="))
    assert home in {m["mountPath"] for m in container(deployment)["volumeMounts"]}
    assert f"--home-dir {home}" in " ".join(_all(name, "RUN"))


def test_the_build_context_keeps_what_the_images_copy() -> None:
    ignored = {
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    assert {".venv", ".git", "service/gen"} <= ignored  # big, or regenerated in the image
    for name in DOCKERFILES:
        for copy in _all(name, "COPY"):
            for path in copy.split()[:-1]:
                assert path not in ignored, (name, path)
