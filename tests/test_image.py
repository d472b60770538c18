"""The cluster image's recipe, read as text (no docker needed): `Dockerfile`, `.dockerignore`, `make image`.

Checks: the final stage is FROM an nvidia/cuda *runtime* image whose CUDA version agrees with the torch index;
torch is installed at exactly the Makefile's pin (the same as pyproject's) from PyTorch's CUDA index, and the
--no-deps packages at the Makefile's pins; the image ends as a non-root user (a USER after the last RUN); HF_HOME
is set and under a VOLUME, and so is every top folder of params.yaml's ``paths.*`` and DVC's cache, except a
folder that is a whole DVC output (DVC deletes an output before rerunning its stage; a mount point cannot be
deleted); no ENV/ARG name looks like a credential and no COPY/ADD takes a credentials-like path; `.dockerignore`
keeps secrets, the venv and the outputs out of the context and every tracked file in; `make -n image` prints a
`docker build` that tags the image and passes GIT_SHA. Each check also runs on a deliberately bad sample, to show
that it can fail.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"
REPO_DIR = "/opt/sdforge"

SECRET_NAME = re.compile(r"AWS_SECRET|AWS_ACCESS_KEY|AWS_SESSION_TOKEN|PASSWORD|TOKEN|SECRET|API_KEY|CREDENTIAL", re.I)
SECRET_PATH = re.compile(r"(^|/)(\.aws|\.env(\..*)?|credentials[^/]*|[^/]*\.pem|[^/]*\.key|\.netrc|config\.local)(/|$)")


# ---- parsing ----


def instructions(text: str) -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` in order: comment lines dropped (also inside a continuation, as docker does),
    ``\\``-continued lines joined."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in text.splitlines():
        if line.lstrip().startswith("#") or (not pending and not line.strip()):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        if full:
            word, _, rest = full.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def substitute(value: str, args: dict[str, str]) -> str:
    """``$NAME`` / ``${NAME}`` replaced by the build args' defaults (unknown names are left as they are)."""
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m[1] or m[2], m[0]), value)


def final_stage(text: str) -> tuple[str, list[tuple[str, str]]]:
    """The final stage's base image (build args resolved) and its instructions after FROM (args resolved)."""
    ins = instructions(text)
    froms = [i for i, (word, _) in enumerate(ins) if word == "FROM"]
    assert froms, "no FROM"
    global_args = dict(_arg(rest) for word, rest in ins[: froms[0]] if word == "ARG")
    args = dict(global_args)
    stage = []
    for word, rest in ins[froms[-1] + 1 :]:
        if word == "ARG":
            name, default = _arg(rest)
            args[name] = default if "=" in rest else global_args.get(name, "")
        stage.append((word, substitute(rest, args)))
    base = substitute(ins[froms[-1]][1].split()[0], global_args)
    return base, stage


def _arg(rest: str) -> tuple[str, str]:
    name, _, default = rest.partition("=")
    return name.strip(), default.strip().strip('"')


def env_vars(stage: list[tuple[str, str]]) -> dict[str, str]:
    """The stage's ENV settings, ``ENV A=1 B=2`` and the legacy ``ENV A 1``."""
    env: dict[str, str] = {}
    for word, rest in stage:
        if word != "ENV":
            continue
        if re.match(r"^\w+=", rest):
            env.update((k, v.strip('"')) for k, v in re.findall(r'(\w+)=("[^"]*"|\S+)', rest))
        else:
            name, _, value = rest.partition(" ")
            env[name] = value.strip()
    return env


def volumes(stage: list[tuple[str, str]]) -> list[str]:
    out = []
    for word, rest in stage:
        if word == "VOLUME":
            out += json.loads(rest) if rest.startswith("[") else rest.split()
    return out


def makefile_var(name: str) -> str:
    match = re.search(rf"^{name}\s*:?=\s*(\S+)", (ROOT / "Makefile").read_text(), re.M)
    assert match, f"no {name} in the Makefile"
    return match[1]


# ---- the checks (each returns its problems; [] = fine) ----


def base_problems(text: str) -> list[str]:
    base, stage = final_stage(text)
    problems = []
    match = re.fullmatch(r"nvidia/cuda:(\d+)\.(\d+)(?:\.\d+)?-(?:cudnn\d*-)?runtime-ubuntu[\d.]+", base)
    if not match:
        return [f"final FROM is not an nvidia/cuda runtime image: {base}"]
    runs = " ".join(rest for word, rest in stage if word == "RUN")
    tags = set(re.findall(r"download\.pytorch\.org/whl/(cu\d+)", runs))
    if tags != {f"cu{match[1]}{match[2]}"}:
        problems.append(f"torch index {sorted(tags)} does not match the base's CUDA {match[1]}.{match[2]}")
    return problems


def pip_installs(stage: list[tuple[str, str]]) -> list[list[str]]:
    """The arguments of every ``pip install`` in the stage's RUNs (``pip``, ``.../pip`` or ``python -m pip``)."""
    out = []
    for word, rest in stage:
        if word != "RUN":
            continue
        for command in re.split(r"&&|\|\||;", rest):
            tokens = command.split()
            for i in range(len(tokens) - 1):
                if tokens[i].rsplit("/", 1)[-1] == "pip" and tokens[i + 1] == "install":
                    out.append([t.strip("'\"") for t in tokens[i + 2 :]])
                    break
    return out


def torch_problems(text: str, pin: str) -> list[str]:
    _, stage = final_stage(text)
    installs = [(args, t) for args in pip_installs(stage) for t in args if re.match(r"torch($|[=<>~!\[])", t)]
    if [t for _, t in installs] != [pin]:
        return [f"torch installs {[t for _, t in installs]}, want exactly [{pin!r}]"]
    args = " ".join(installs[0][0])
    if not re.search(r"--index-url[ =]https://download\.pytorch\.org/whl/cu\d+(\s|$)", args):
        return [f"torch is not installed from a CUDA index (--index-url .../whl/cuNNN): {args}"]
    return []


def user_problems(text: str) -> list[str]:
    _, stage = final_stage(text)
    last_run = max((i for i, (word, _) in enumerate(stage) if word == "RUN"), default=-1)
    users = [(i, rest) for i, (word, rest) in enumerate(stage) if word == "USER"]
    if not users:
        return ["no USER in the final stage"]
    i, user = users[-1]
    problems = []
    if i < last_run:
        problems.append(f"the last USER ({user}) comes before the last RUN")
    if user.split(":")[0] in ("root", "0"):
        problems.append(f"the image runs as {user}")
    return problems


def secret_problems(text: str) -> list[str]:
    problems = []
    for word, rest in instructions(text):
        if word == "ARG":
            names = [_arg(rest)[0]]
        elif word == "ENV":
            names = list(env_vars([(word, rest)]))
        else:
            names = []
        problems += [f"{word} {name} looks like a credential" for name in names if SECRET_NAME.search(name)]
        if word in ("COPY", "ADD"):
            sources = [s for s in rest.split() if not s.startswith("--")][:-1]
            problems += [f"{word} of {s}" for s in sources if SECRET_PATH.search(s.strip('"[],'))]
    return problems


def excluded(path: str, patterns: list[str]) -> bool:
    """Whether docker leaves ``path`` out of the context: the last pattern matching it or one of its parent
    folders decides (``!`` re-includes); patterns are anchored at the root, ``**`` spans folders."""
    parts = path.split("/")
    candidates = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    result = False
    for raw in patterns:
        negate = raw.startswith("!")
        regex = _pattern_regex(raw.lstrip("!").strip("/"))
        if any(regex.fullmatch(c) for c in candidates):
            result = not negate
    return result


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out)


def dockerignore_patterns(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


# ---- the tests ----


@pytest.fixture(scope="module")
def dockerfile() -> str:
    return DOCKERFILE.read_text()


@pytest.fixture(scope="module")
def stage(dockerfile: str) -> list[tuple[str, str]]:
    return final_stage(dockerfile)[1]


BAD = """\
ARG CUDA=12.8.1
FROM nvidia/cuda:${CUDA}-runtime-ubuntu24.04 AS build
FROM nvidia/cuda:${CUDA}-devel-ubuntu24.04
ARG AWS_SECRET_ACCESS_KEY
ENV MLFLOW_TRACKING_PASSWORD=hunter2 HF_HOME=/root/.cache/hf
COPY .aws/credentials /root/.aws/credentials
USER sdforge
RUN pip install torch==2.12.0 && pip install -e .
"""


def test_base_is_cuda_runtime_matching_the_torch_index(dockerfile: str) -> None:
    base, _ = final_stage(dockerfile)
    assert base.startswith("nvidia/cuda:") and "-runtime-" in base and "devel" not in base, base
    assert base_problems(dockerfile) == []
    assert base_problems(BAD) == [
        "final FROM is not an nvidia/cuda runtime image: nvidia/cuda:12.8.1-devel-ubuntu24.04"
    ]
    wrong_index = dockerfile.replace("download.pytorch.org/whl/${TORCH_CUDA}", "download.pytorch.org/whl/cu130")
    assert wrong_index != dockerfile and base_problems(wrong_index), "a cu130 index on a CUDA 12.8 base must fail"


def test_torch_is_the_pinned_version_from_a_cuda_index(dockerfile: str) -> None:
    pin = makefile_var("TORCH")
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert pin in deps, f"the Makefile pins {pin}, pyproject.toml {[d for d in deps if d.startswith('torch')]}"
    assert re.fullmatch(r"torch==\d+\.\d+\.\d+", pin), pin
    assert torch_problems(dockerfile, pin) == []
    assert torch_problems(BAD, pin) == [f"torch installs ['torch==2.12.0'], want exactly [{pin!r}]"]
    pypi = re.sub(r"--index-url \S+ ", "", dockerfile)
    assert torch_problems(pypi, pin) and "CUDA index" in torch_problems(pypi, pin)[0]


def test_project_and_no_deps_packages_at_the_makefile_pins(stage: list[tuple[str, str]]) -> None:
    installs = pip_installs(stage)
    no_deps = [args for args in installs if "--no-deps" in args]
    assert len(no_deps) == 1, installs
    packages = {a for a in no_deps[0] if not a.startswith("-")}
    assert packages == {makefile_var("IMG2DATASET"), makefile_var("OPEN_CLIP")}
    project = [args for args in installs if "-e" in args]
    assert len(project) == 1 and project[0][project[0].index("-e") + 1] == "."
    # the cluster's packages come with the project (pyproject), resolved with it: no second pin to drift
    assert {a for a in project[0] if "==" in a} == set()
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert {d.split(">")[0].split("=")[0] for d in deps} >= {"prefect-kubernetes", "kubernetes"}
    assert "pip uninstall -y dataclasses" in " ".join(rest for word, rest in stage if word == "RUN")


def test_runs_as_a_non_root_user_after_the_last_run(dockerfile: str, stage: list[tuple[str, str]]) -> None:
    assert user_problems(dockerfile) == []
    assert [rest for word, rest in stage if word == "USER"] == ["sdforge"]
    runs = " ".join(rest for word, rest in stage if word == "RUN")
    assert "useradd --create-home --uid 1000 --user-group --shell /bin/bash sdforge" in runs
    assert user_problems(BAD) == ["the last USER (sdforge) comes before the last RUN"]
    assert user_problems(dockerfile.replace("USER sdforge", "USER 0:0")) == ["the image runs as 0:0"]


def test_repo_venv_and_runtime_env(stage: list[tuple[str, str]]) -> None:
    assert ("WORKDIR", REPO_DIR) in stage
    env = env_vars(stage)
    assert env["PATH"].split(":")[0] == f"{REPO_DIR}/.venv/bin"
    assert env["VIRTUAL_ENV"] == f"{REPO_DIR}/.venv"
    assert env["SDFORGE_PROGRESS"] == "0"
    assert env["PYTHONUNBUFFERED"] == "1"
    assert env["HF_HOME"] == "/cache/huggingface"
    labels = " ".join(rest for word, rest in stage if word == "LABEL")
    assert 'org.opencontainers.image.revision="unknown"' in labels  # GIT_SHA's default, resolved
    assert "org.opencontainers.image.source=" in labels


def dvc_whole_outputs(params: dict) -> set[str]:
    """dvc.yaml's outputs that resolve, without a foreach ``${key}``, to a single path (``${paths.x}`` only)."""
    outs: set[str] = set()
    for stage in yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"].values():
        for out in stage.get("do", stage).get("outs", []):
            path = next(iter(out)) if isinstance(out, dict) else out
            path = re.sub(r"\$\{paths\.(\w+)\}", lambda m: str(params["paths"][m[1]]), path)
            if "${" not in path:
                outs.add(path.strip("/"))
    return outs


def volume_problems(text: str, params_file: str = "params.yaml") -> list[str]:
    _, stage = final_stage(text)
    mounts = volumes(stage)
    params = yaml.safe_load((ROOT / params_file).read_text())
    whole = dvc_whole_outputs(params)
    tops = {str(Path(v).parts[0]) for v in params["paths"].values() if not Path(v).is_absolute()} | {".dvc/cache"}
    problems = []
    hf_home = env_vars(stage).get("HF_HOME")
    if not hf_home or not any(hf_home == m or hf_home.startswith(m.rstrip("/") + "/") for m in mounts):
        problems.append(f"HF_HOME {hf_home} is under no VOLUME {mounts}")
    for top in sorted(tops - whole):
        if f"{REPO_DIR}/{top}" not in mounts:
            problems.append(f"work folder {top} is not a VOLUME")
    for top in sorted(whole):
        if f"{REPO_DIR}/{top}" in mounts:
            problems.append(f"{top} is a whole DVC output: a VOLUME there breaks its stage's rerun")
    return problems


def test_hf_home_and_the_work_dir_are_volumes(dockerfile: str, stage: list[tuple[str, str]]) -> None:
    """The image is the cluster's: its volumes follow the full config (models one level down, so a volume)."""
    assert volume_problems(dockerfile, "configs/full/params.yaml") == []
    assert "/cache" in volumes(stage) and f"{REPO_DIR}/data" in volumes(stage)
    assert volume_problems(BAD) == [
        "HF_HOME /root/.cache/hf is under no VOLUME []",
        *[f"work folder {t} is not a VOLUME" for t in [".dvc/cache", "checkpoints", "data", "eval", "evaluations",
                                                     "metrics", "runs"]],
    ]
    # the demo's params keep prepare_models' output at the top (`models`): a volume there is what the check flags
    assert "models" in dvc_whole_outputs(yaml.safe_load((ROOT / "params.yaml").read_text()))
    assert volume_problems(dockerfile, "params.yaml") == [
        "models is a whole DVC output: a VOLUME there breaks its stage's rerun"
    ]


def test_no_credentials_in_env_args_or_copies(dockerfile: str) -> None:
    assert secret_problems(dockerfile) == []
    assert not re.search(r"(AKIA[0-9A-Z]{16}|aws_secret_access_key|BEGIN [A-Z ]*PRIVATE KEY)", dockerfile, re.I)
    assert secret_problems(BAD) == [
        "ARG AWS_SECRET_ACCESS_KEY looks like a credential",
        "ENV MLFLOW_TRACKING_PASSWORD looks like a credential",
        "COPY of .aws/credentials",
    ]


def test_dockerignore_keeps_secrets_and_outputs_out_and_tracked_files_in() -> None:
    patterns = dockerignore_patterns((ROOT / ".dockerignore").read_text())
    out = [
        ".env",
        ".env.production",
        "sub/dir/.env",
        ".aws/credentials",
        "deploy/.aws/config",
        "credentials.json",
        "keys/tls.pem",
        "keys/server.key",
        ".dvc/config.local",
        ".git/config",
        ".git/logs/HEAD",
        ".prefect/profiles.toml",
        ".venv/bin/python",
        "data/shards/x.tar",
        "checkpoints/phase1/unet/model.safetensors",
        "models/vae/config.json",
        "mlruns/0/meta.yaml",
        ".dvc/cache/files/md5/ab/cd",
        ".dvc/tmp/rwlock",
        "sdforge/__pycache__/config.cpython-311.pyc",
        ".gpu-wheels/torch.whl",
    ]
    kept = ["Dockerfile", "pyproject.toml", "dvc.yaml", "params.yaml", ".dvc/config", ".git/HEAD", ".git/index"]
    kept += ["sdforge/config/__init__.py", "sdforge/config/train.py", "model/__init__.py", "stages/train.py"]
    assert [p for p in out if not excluded(p, patterns)] == []
    assert [p for p in kept if excluded(p, patterns)] == []
    assert excluded("data/x", ["data", "!data/x"]) is False and excluded("a/data", ["data"]) is False
    if shutil.which("git") and (ROOT / ".git").exists():
        tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
        assert [p for p in tracked.splitlines() if excluded(p, patterns)] == []


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
@pytest.mark.parametrize("image", [None, "registry.example.com/sdforge:test"])
def test_make_image_builds_a_tagged_image_with_git_sha(image: str | None) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "IMAGE")}
    cmd = ["make", "-n", "--no-print-directory", "image"] + ([f"IMAGE={image}"] if image else [])
    printed = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=True).stdout.strip()
    tag = re.escape(image) if image else re.escape("sdforge:$(git rev-parse --short HEAD)")
    assert re.fullmatch(rf"docker build -t {tag} --build-arg GIT_SHA=\$\(git rev-parse HEAD\) \.", printed), printed
    prerequisites = re.findall(r"^(?!\.PHONY)[^#\s=][^:=\n]*:(?!=)([^;\n]*)", (ROOT / "Makefile").read_text(), re.M)
    assert prerequisites and not [p for p in prerequisites if re.search(r"(^|\s)image(\s|$)", p)]
