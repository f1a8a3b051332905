"""The Dockerfile's rules (no Docker engine needed):

- every RUN step calls only scripts that CI exercises (scripts reached from .ci/run, through the Makefile
  and the test suite it runs), plus the base image's package manager and `kvstack doctor`; nothing is
  pip-installed or downloaded by hand in the Dockerfile;
- no pin (version, wheel, checksum) of any base is written in the Dockerfile: the install step reads the
  chosen base's pin files (build arg KVSTACK_BASE), which the build context carries; the default base
  images' Pythons have pinned wheels, for every base;
- multi-stage, both targets, overridable base images, the heavy install layer depending only on the
  base's pin files and the install scripts, caches/wheelhouse/CA bundle as mounts only, `kvstack doctor`
  last, `vllm serve` entrypoint;
- scripts/docker_build.sh builds one base's image (--base NAME, --base-image IMAGE): its tag, build arg,
  deps-image key and labels follow that base;
- the labels: OCI ones in the Dockerfile, the base, pins and patches (with status) from
  scripts/docker_build.sh;
- hadolint clean (ci/hadolint.sh).
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvstack.release.patchstack import read_series
from kvstack.release.pins import COMPONENTS, base_names, default_base, load_base, load_pin

from kvtest import REPO  # noqa: E402
DOCKERFILE = REPO / "Dockerfile"
SCRIPT_RE = re.compile(r"(?<![\w.-])((?:scripts|ci)/[\w.-]+\.(?:sh|py))")


def instructions(path: Path | None = None) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    out, buf = [], ""
    for raw in (path or DOCKERFILE).read_text().splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if buf and line.startswith("#"):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        word, _, rest = buf.partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    return out


def stages() -> dict[str, list[tuple[str, str]]]:
    """Stage name -> its instructions (FROM line first)."""
    result: dict[str, list[tuple[str, str]]] = {}
    current = None
    for ins, args in instructions():
        if ins == "FROM":
            m = re.match(r"(\S+)\s+AS\s+(\S+)$", args, re.I)
            assert m, f"every stage is named: FROM {args}"
            current = m.group(2)
            result[current] = []
        if current is not None:
            result[current].append((ins, args))
    return result


def dockerignore_patterns() -> list[tuple[bool, str]]:
    """(is_exception, pattern) pairs of .dockerignore, in order."""
    out = []
    for raw in (REPO / ".dockerignore").read_text().splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            neg = line.startswith("!")
            out.append((neg, line[1:].strip("/") if neg else line.strip("/")))
    return out


def _ignored(rel: str, patterns: list[tuple[bool, str]]) -> bool:
    """Docker's rule: a path is ignored when the last pattern matching it or one of its parents excludes it."""
    parts = rel.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for neg, pat in patterns:
        if pat.startswith("**/"):
            hit = any(fnmatch.fnmatchcase(p, pat[3:]) for p in parts)
        else:
            hit = any(fnmatch.fnmatchcase(p, pat) and p.count("/") == pat.count("/") for p in prefixes)
        if hit:
            ignored = not neg
    return ignored


def build_context_files() -> list[str]:
    """The files `docker build .` sends from this checkout, as .dockerignore filters them."""
    patterns = dockerignore_patterns()
    keep_dirs = {pat.split("/")[0] for neg, pat in patterns if neg}
    files = []
    for top in sorted(REPO.iterdir()):
        if top.name not in keep_dirs and _ignored(top.name, patterns):
            continue
        for path in [top] if top.is_file() else sorted(top.rglob("*")):
            rel = str(path.relative_to(REPO))
            if path.is_file() and not _ignored(rel, patterns):
                files.append(rel)
    return files


def run_command(args: str) -> str:
    """A RUN's shell command without its --mount/--network flags."""
    return re.sub(r"^(--\w+=\S+\s+)+", "", args)


def script_refs(text: str) -> set[str]:
    return set(SCRIPT_RE.findall(text))


def _make_targets() -> dict[str, tuple[list[str], str]]:
    """Makefile target -> (prerequisites, recipe text)."""
    targets: dict[str, tuple[list[str], str]] = {}
    current = None
    for line in (REPO / "Makefile").read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.-]+)\s*:(?!=)\s*([^#=]*?)(\s*##.*)?$", line)
        if m and not line.startswith("\t"):
            current = m.group(1)
            targets[current] = (m.group(2).split(), "")
        elif line.startswith("\t") and current:
            deps, recipe = targets[current]
            targets[current] = (deps, recipe + line + "\n")
        elif line.strip() and not line.startswith("\t"):
            current = None
    return targets


def ci_exercised_scripts() -> set[str]:
    """Scripts CI runs: named in .ci/run, in the Makefile targets it reaches, in the tests those run
    (when a reached recipe runs pytest), and, transitively, in those scripts themselves."""
    ci_run = REPO / ".ci" / "run"
    assert ci_run.is_file(), ".ci/run is missing: nothing is exercised by CI"
    text = ci_run.read_text()
    found = script_refs(text)
    makefile = REPO / "Makefile"
    recipes = ""
    if makefile.is_file():
        targets = _make_targets()
        todo = re.findall(r"\bmake\s+(?:-\S+\s+)*([a-z][\w-]*)", text)
        seen: set[str] = set()
        while todo:
            t = todo.pop()
            if t in seen or t not in targets:
                continue
            seen.add(t)
            deps, recipe = targets[t]
            todo += deps + re.findall(r"\$\(MAKE\)\s+([a-z][\w-]*)", recipe)
            recipes += recipe
        found |= script_refs(recipes)
    if "pytest" in text + recipes:
        names = {p.name: f"{p.parent.name}/{p.name}" for d in ("scripts", "ci") for p in (REPO / d).glob("*.[ps][yh]")}
        for test in (REPO / "tests").rglob("*.py"):
            body = test.read_text()
            found |= script_refs(body)
            found |= {rel for name, rel in names.items() if re.search(rf"['\"/]{re.escape(name)}['\"]", body)}
    todo = list(found)
    while todo:
        path = REPO / todo.pop()
        if path.is_file():
            for ref in script_refs(path.read_text()) - found:
                found.add(ref)
                todo.append(ref)
    return found


# Commands a RUN may use besides exercised scripts: the base image's package manager and the doctor.
ALLOWED_COMMANDS = {"apt-get", "rm", "bash", "kvstack"}


def _commands(cmd: str) -> list[list[str]]:
    out = []
    for part in re.split(r"&&|\|\||;|\|", cmd):
        words = shlex.split(part)
        while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):  # VAR=value prefixes
            words = words[1:]
        if words:
            out.append(words)
    return out


def test_every_run_step_calls_only_scripts_ci_exercises():
    exercised = ci_exercised_scripts()
    runs = [run_command(args) for ins, args in instructions() if ins == "RUN"]
    assert runs
    called = set()
    for cmd in runs:
        for words in _commands(cmd):
            assert words[0] in ALLOWED_COMMANDS, f"RUN uses {words[0]!r}; put install logic in a CI-run script: {cmd}"
            if words[0] == "bash":
                assert len(words) >= 2 and SCRIPT_RE.search(words[1]), f"bash must run a repo script: {cmd}"
            if words[0] == "kvstack":
                assert words[1:] == ["doctor"], cmd
            if words[0] == "rm":
                assert words[1:] == ["-rf", "/var/lib/apt/lists/*"], cmd
        refs = script_refs(cmd)
        called |= refs
        assert refs <= exercised, f"RUN calls {sorted(refs - exercised)}, which CI never runs: {cmd}"
    assert "scripts/install_image.sh" in called, "the install step is scripts/install_image.sh"


def test_no_pin_is_written_in_the_dockerfile_and_the_context_carries_the_pin_files():
    text = DOCKERFILE.read_text()
    for base in base_names():
        for comp in COMPONENTS:
            for key, value in load_pin(comp, base).values.items():
                if key == "PROJECT" or key.endswith("_PROJECT"):
                    continue  # a project name, not a pin
                assert value not in text, f"{comp}/{base}.env {key}={value} is duplicated in the Dockerfile"
    # ARGs are the base, the target, the base images and the label values: none names a pinned component,
    # and the base has no default (vllm/default is the one place that names it; docker_build.sh reads it).
    for ins, args in instructions():
        if ins == "ARG":
            name = args.split("=", 1)[0]
            assert re.fullmatch(r"TARGET|KVSTACK_BASE|(CUDA|CPU)_BASE_IMAGE|KVSTACK_(REVISION|VERSION|SOURCE)", name), name
    assert not any(ins == "ARG" and args.startswith("KVSTACK_BASE=") for ins, args in instructions())
    install = (REPO / "scripts" / "install_image.sh").read_text()
    assert "lib_base.sh" in install and "resolve_base" in install and "pin.env" not in install
    ignore = [ln.strip() for ln in (REPO / ".dockerignore").read_text().splitlines()
              if ln.strip() and not ln.startswith("#")]
    assert ignore[0] == "*", ".dockerignore is an allow-list"
    allowed = {ln[1:].rstrip("/") for ln in ignore if ln.startswith("!")}
    # Of vllm/ and lmcache/ only the pins: the folders as a whole would send the fetched sources (src/).
    for needed in ("vllm/default", "vllm/*.env", "lmcache/*.env", "patches", "scripts", "kvstack",
                   "pyproject.toml"):
        assert needed in allowed, f"the build context must carry {needed}"
    for never in ("tests", ".venv", "build", "upstream", "vllm/src", "lmcache/src", ".git", "bench"):
        assert not any(a == never or a.startswith(never + "/") for a in allowed), never
    assert not {"vllm", "lmcache", "vllm/*", "lmcache/*"} & allowed, "vllm/ or lmcache/ whole: their src/ would go"
    context = build_context_files()
    for needed in ("vllm/default", "scripts/install_image.sh", "scripts/build_env.sh", "scripts/lib_base.sh",
                   "kvstack/release/doctor.py", "pyproject.toml"):
        assert needed in context, needed
    # Every base's pins and series: `kvstack doctor` in the image finds the base from the installed versions.
    for base in base_names():
        for comp in COMPONENTS:
            pin = load_pin(comp, base)
            assert str(pin.file.relative_to(REPO)) in context
            for patch in read_series(pin.series_dir):
                assert str(patch.relative_to(REPO)) in context
    leaked = [f for f in context if f.startswith(("tests/", ".venv", "build/", ".git/", "upstream/"))
              or (f.startswith(("vllm/", "lmcache/"))
                  and not re.fullmatch(r"(vllm|lmcache)/[^/]+\.env|vllm/default", f))
              or "__pycache__" in f]
    assert not leaked, leaked[:10]
    # ... and a fetched tree there would not go either (whether or not this checkout has fetched one).
    patterns = dockerignore_patterns()
    for comp in COMPONENTS:
        for rel in (f"{comp}/src/{default_base()}/PKG-INFO", f"{comp}/src/{default_base()}/setup.py",
                    f"{comp}/src/{default_base()}/{comp}/__init__.py", f"{comp}/src/x.env"):
            assert _ignored(rel, patterns), rel


def _default_args() -> dict[str, str]:
    return {m.group(1): m.group(2) for ins, args in instructions() if ins == "ARG"
            for m in [re.match(r"(\w+)=(\S+)", args)] if m}


def test_stages_targets_bases_doctor_last_and_entrypoint():
    st = stages()
    assert {"runtime-cuda", "runtime-cpu", "runtime", "wheelhouse", "deps", "final"} <= set(st)
    assert list(st)[-1] == "final", "the last stage is the image"
    defaults = _default_args()
    assert defaults["TARGET"] == "cuda"
    assert st["runtime-cuda"][0][1].startswith("${CUDA_BASE_IMAGE} ")
    assert st["runtime-cpu"][0][1].startswith("${CPU_BASE_IMAGE} ")
    assert st["runtime"][0][1].startswith("runtime-${TARGET} ")
    assert st["wheelhouse"] == [("FROM", "scratch AS wheelhouse")], "the default wheelhouse is empty"
    assert st["deps"][0][1].startswith("runtime ") and st["final"][0][1].startswith("deps ")
    # The cpu base's Python is checked before anything is installed on it.
    cpu_runs = [a for i, a in st["runtime-cpu"] if i == "RUN"]
    assert 'scripts/check_python.sh --base "$KVSTACK_BASE" python3.11' in cpu_runs[0]
    # Only scripts/ and vllm/ (its pins name the torch wheel) are mounted there (a whole-context mount
    # would tie the layer to every file).
    mounts = re.findall(r"--mount=(\S+)", cpu_runs[0])
    assert sorted(mounts) == ["type=bind,source=scripts,target=/tmp/kvstack-context/scripts",
                              "type=bind,source=vllm,target=/tmp/kvstack-context/vllm"], mounts
    # deps: the heavy layer sees only the chosen base's pin files and the install scripts (kvstack's
    # sources, other bases' pins and every series come later).
    assert ("ARG", "KVSTACK_BASE") in st["deps"] and ("ARG", "KVSTACK_BASE") in st["final"]
    deps_copies = [a.split() for i, a in st["deps"] if i == "COPY"]
    assert [c[-1] for c in deps_copies] == ["${KVSTACK_SRC}/vllm/", "${KVSTACK_SRC}/lmcache/",
                                            "${KVSTACK_SRC}/scripts/"]
    assert [c[:-1] for c in deps_copies[:2]] == [["vllm/${KVSTACK_BASE}.env"], ["lmcache/${KVSTACK_BASE}.env"]]
    assert sorted(f for c in deps_copies for f in c[:-1]) == sorted(
        ["vllm/${KVSTACK_BASE}.env", "lmcache/${KVSTACK_BASE}.env", "scripts/install_image.sh",
         "scripts/build_env.sh", "scripts/lib_wheels.sh", "scripts/lib_base.sh", "scripts/check_python.sh"])
    # What the install scripts source or run before --deps-only stops is among what deps copies.
    copied = {f.rsplit("/", 1)[-1] for c in deps_copies for f in c[:-1]}
    for script in ("install_image.sh", "build_env.sh"):
        body = (REPO / "scripts" / script).read_text().split("--deps-only: done")[0]
        for ref in re.findall(r"scripts/([\w.-]+\.sh)", body):
            assert ref in copied, f"{script} uses scripts/{ref} before --deps-only stops: copy it in deps"
    deps_runs = [a for i, a in st["deps"] if i == "RUN"]
    final_runs = [a for i, a in st["final"] if i == "RUN"]
    assert len(deps_runs) == 1 and "--deps-only" in deps_runs[0]
    assert len(final_runs) == 1 and "--deps-only" not in final_runs[0]
    assert [a for i, a in st["final"] if i in ("COPY", "ADD")] == [". ${KVSTACK_SRC}"]
    for run in deps_runs + final_runs:
        # caches, the wheelhouse and the CA bundle are mounts: none reaches a layer
        assert "--mount=type=cache" in run and "target=/root/.cache" in run
        assert "--mount=type=bind,from=wheelhouse,target=/wheelhouse" in run
        assert "--mount=type=secret,id=pip_cert " in run and "KVSTACK_PIP_CERT=/run/secrets/pip_cert" in run
        assert run_command(run).replace("--deps-only ", "") == run_command(final_runs[0])
        assert '--base "$KVSTACK_BASE"' in run
    # The install step is the last build step and ends with `kvstack doctor` (a broken image fails to
    # build); after it, metadata only.
    final = st["final"]
    last_run = max(n for n, (i, _) in enumerate(final) if i == "RUN")
    assert {i for i, _ in final[last_run + 1:]} <= {"ENV", "ARG", "LABEL", "EXPOSE", "ENTRYPOINT"}
    install = (REPO / "scripts" / "install_image.sh").read_text().rstrip().splitlines()
    assert install[-1].strip() == '"$venv/bin/kvstack" doctor', "kvstack doctor is the last build step"
    assert "PIP_CERT" not in " ".join(a for i, a in final if i == "ENV")
    entry = [a for i, a in final if i == "ENTRYPOINT"]
    assert entry and json.loads(entry[-1]) == ["vllm", "serve"]
    # Build tools the run time does not need never enter a run-time stage.
    for name in ("runtime-cuda", "runtime-cpu", "runtime", "deps", "final"):
        text = " ".join(a for _, a in st[name])
        for tool in ("build-essential", "cmake", "ninja-build", "curl", "wget", "cuda-nvcc", "-devel-"):
            assert tool not in text, f"{tool} in stage {name}"


def _python_tag(stage: list[tuple[str, str]], base: str) -> str:
    env = " ".join(a for i, a in stage if i == "ENV")
    m = re.search(r"KVSTACK_PYTHON=\S*python(\d)\.(\d+)", env) or re.search(r"python:(\d)\.(\d+)", base)
    assert m, f"cannot tell the Python version of {base}"
    return f"CP{m.group(1)}{m.group(2)}"


@pytest.mark.parametrize("base", base_names())
@pytest.mark.parametrize("target", ["cuda", "cpu"])
def test_default_base_image_python_has_every_wheel_pinned(target, base):
    st, defaults = stages(), _default_args()
    image = defaults[f"{target.upper()}_BASE_IMAGE"]
    tag = _python_tag(st[f"runtime-{target}"], image)
    res = subprocess.run(["bash", str(REPO / "scripts" / "install_image.sh"), "--base", base, "--target", target,
                          "--dry-run", "--py-tag", tag], capture_output=True, text=True)
    assert res.returncode == 0, f"base {base}, {target} on {image} ({tag}): {res.stderr}"
    assert f"base={base}\n" in res.stdout
    wheels = re.findall(r"^wheel (\S+) sha256=([0-9a-f]{64})$", res.stdout, re.M)
    assert len(wheels) == 3, res.stdout
    pinned = {v for c in COMPONENTS for v in load_pin(c, base).values.values()}
    for name, sha in wheels:
        assert name in pinned and sha in pinned, (name, sha)


def test_labels_in_dockerfile():
    labels = " ".join(a for i, a in stages()["final"] if i == "LABEL")
    for key in ("source", "revision", "version", "title", "licenses"):
        assert f"org.opencontainers.image.{key}=" in labels, key
    assert 'kvstack.base="${KVSTACK_BASE}"' in labels


def _build_command(*args: str, env: dict[str, str] | None = None) -> list[str]:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("KVSTACK_", "STORAGE_DRIVER", "BUILDAH_"))},
           **(env or {})}
    env["PYTHON"] = sys.executable
    res = subprocess.run(["bash", str(REPO / "scripts" / "docker_build.sh"), "--print", *args],
                         capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr
    return shlex.split(res.stdout)


def test_docker_build_per_builder_secret_and_wheelhouse(tmp_path):
    ca = tmp_path / "ca.crt"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    wh = tmp_path / "wheels"
    wh.mkdir()
    env = {"KVSTACK_CACHE": str(tmp_path / "no-cache")}  # no default wheelhouse
    docker = _build_command("--target", "cpu", "--ca-cert", str(ca), "--wheelhouse", str(wh), env=env)
    assert docker[:2] == ["docker", "build"]
    assert docker[docker.index("--secret") + 1] == f"id=pip_cert,src={ca}"
    assert docker[docker.index("--build-context") + 1] == f"wheelhouse={wh}"
    assert "--pull=never" not in docker and "--storage-driver" not in docker
    # Buildah: the deps stage as its own image (tagged by a hash of its inputs), then the image on it;
    # chroot isolation; a local base image is never pulled.
    base = default_base()
    deps, bud = _buildah_commands("--base", base, "--base-image", "localhost/base:x", "--ca-cert", str(ca), env=env)
    for c in (deps, bud):
        assert c[:5] == ["buildah", "--storage-driver", "vfs", "bud", "--isolation"]
        assert c[c.index("--isolation") + 1] == "chroot" and "--pull=never" in c
        assert c[c.index("--secret") + 1] == f"id=pip_cert,src={ca}"
        assert "CPU_BASE_IMAGE=localhost/base:x" in c and f"KVSTACK_BASE={base}" in c
    deps_tag = deps[deps.index("-t") + 1]
    assert deps[deps.index("--target") + 1] == "deps"
    assert re.fullmatch(rf"localhost/kvstack-deps:{re.escape(base)}-cpu-[0-9a-f]{{16}}", deps_tag), deps_tag
    assert bud[bud.index("--target") + 1] == "final"
    assert f"deps=docker-image://{deps_tag}" in bud
    assert not any(w.startswith("--label") for w in deps), "labels only on the image: the deps tag stays stable"
    # --deps-only: the deps image's build alone (docker: --target deps, no tag, no labels).
    only = subprocess.run(["bash", str(REPO / "scripts" / "docker_build.sh"), "--print", "--builder", "buildah",
                           "--storage-driver", "vfs", "--target", "cpu", "--base", base, "--base-image",
                           "localhost/base:x", "--ca-cert", str(ca), "--deps-only"], capture_output=True, text=True,
                          env={**os.environ, **env, "PYTHON": sys.executable})
    assert only.returncode == 0 and [shlex.split(ln) for ln in only.stdout.splitlines()] == [deps], only.stderr
    docker_deps = _build_command("--target", "cpu", "--base", base, "--deps-only", env=env)
    assert docker_deps[docker_deps.index("--target") + 1] == "deps"
    assert "-t" not in docker_deps and not any(w == "--label" for w in docker_deps)
    podman = _build_command("--builder", "podman", "--storage-driver", "overlay", "--no-wheelhouse", env=env)
    assert podman[:4] == ["podman", "--storage-driver", "overlay", "build"]
    # The default wheelhouse is kvstack's wheel cache, when there is one.
    (tmp_path / "cache" / "wheels").mkdir(parents=True)
    cmd = _build_command("--target", "cpu", env={"KVSTACK_CACHE": str(tmp_path / "cache")})
    assert cmd[cmd.index("--build-context") + 1] == f"wheelhouse={tmp_path / 'cache' / 'wheels'}"


def _buildah_commands(*args: str, env: dict[str, str] | None = None) -> list[list[str]]:
    """The deps image's and the image's build commands (buildah, vfs, cpu), as --print shows them."""
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("KVSTACK_", "STORAGE_DRIVER", "BUILDAH_"))},
           **(env or {}), "PYTHON": sys.executable}
    out = subprocess.run(["bash", str(REPO / "scripts" / "docker_build.sh"), "--print", "--builder", "buildah",
                          "--storage-driver", "vfs", "--target", "cpu", *args], capture_output=True, text=True,
                         env=env)
    assert out.returncode == 0, out.stderr
    return [shlex.split(line) for line in out.stdout.splitlines()]


def test_docker_build_per_base_tag_build_arg_and_deps_key(tmp_path):
    """Each base gets its own image tag, KVSTACK_BASE build arg and deps image, keyed by that base's pin
    files only; --base defaults to $KVSTACK_BASE, else vllm/default."""
    env = {"KVSTACK_CACHE": str(tmp_path / "no-cache")}
    version = re.search(r'^version *= *"([^"]+)"', (REPO / "pyproject.toml").read_text(), re.M).group(1)
    deps_tags = {}
    for base in base_names():
        deps, bud = _buildah_commands("--base", base, env=env)
        assert bud[bud.index("-t") + 1] == f"kvstack:{version}-{base}-cpu"
        for c in (deps, bud):
            assert f"KVSTACK_BASE={base}" in c
        deps_tags[base] = deps[deps.index("-t") + 1]
        assert deps_tags[base].startswith(f"localhost/kvstack-deps:{base}-cpu-")
        labels = dict(bud[i + 1].split("=", 1) for i, w in enumerate(bud) if w == "--label")
        assert labels["kvstack.base"] == base and labels["kvstack.base.label"] == load_base(base).label
        assert labels["kvstack.pin.vllm.version"] == load_pin("vllm", base).version
        assert labels["org.opencontainers.image.title"] == f"kvstack (cpu, base {base})"
        # docker: the same tag and build arg
        cmd = _build_command("--target", "cpu", "--base", base, env=env)
        assert cmd[cmd.index("-t") + 1] == f"kvstack:{version}-{base}-cpu" and f"KVSTACK_BASE={base}" in cmd
    assert len(set(deps_tags.values())) == len(deps_tags), deps_tags
    # No --base: $KVSTACK_BASE, else vllm/default.
    file_default = (REPO / "vllm" / "default").read_text().strip()
    for env_base in base_names():
        deps, _ = _buildah_commands(env={**env, "KVSTACK_BASE": env_base})
        assert deps[deps.index("-t") + 1] == deps_tags[env_base]
    deps, _ = _buildah_commands(env=env)
    assert deps[deps.index("-t") + 1] == deps_tags[file_default]


def _fake_repo(tmp_path: Path) -> Path:
    """A copy of what docker_build.sh reads (Dockerfile, scripts, the pins, pyproject, kvstack, patches)."""
    root = tmp_path / "repo"
    for rel in ("Dockerfile", "pyproject.toml"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, root / rel)
    for rel in ("scripts", "kvstack", "patches"):
        shutil.copytree(REPO / rel, root / rel, ignore=shutil.ignore_patterns("__pycache__"))
    for rel in ("vllm", "lmcache"):  # the pins, not the fetched sources
        shutil.copytree(REPO / rel, root / rel, ignore=shutil.ignore_patterns("src"))
    return root


def test_deps_key_follows_only_the_chosen_base_pins(tmp_path):
    """Editing one base's pin file changes that base's deps image tag, not another base's."""
    bases = base_names()
    if len(bases) < 2:
        pytest.skip("one base only")
    root = _fake_repo(tmp_path)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("KVSTACK_", "STORAGE_DRIVER", "BUILDAH_"))},
           "KVSTACK_CACHE": str(tmp_path / "no-cache"), "PYTHON": sys.executable}

    def deps_tag(base: str) -> str:
        out = subprocess.run(["bash", str(root / "scripts" / "docker_build.sh"), "--print", "--builder", "buildah",
                              "--storage-driver", "vfs", "--target", "cpu", "--base", base, "--deps-only"],
                             capture_output=True, text=True, env=env)
        assert out.returncode == 0, out.stderr
        cmd = shlex.split(out.stdout.splitlines()[0])
        return cmd[cmd.index("-t") + 1]

    before = {b: deps_tag(b) for b in bases}
    changed, other = bases[-1], bases[0]
    pin = root / "vllm" / f"{changed}.env"
    pin.write_text(pin.read_text().replace("CPU_WHEEL_SHA256=", "CPU_WHEEL_SHA256=0"))
    assert deps_tag(changed) != before[changed]
    assert deps_tag(other) == before[other]
    # the install scripts feed every base's key
    (root / "scripts" / "lib_base.sh").write_text((root / "scripts" / "lib_base.sh").read_text() + "\n# x\n")
    assert deps_tag(other) != before[other]


@pytest.mark.parametrize("args, message", [
    (["--builder", "kaniko"], "--builder must be docker, podman or buildah, not 'kaniko'"),
    (["--base", "no-such-base"], "unknown base 'no-such-base'"),
    (["--base", "localhost/kvstack-base:bookworm"], "the container's base image is --base-image"),
    (["--base-image"], "--base-image needs a value"),
    (["--builder"], "--builder needs a value"),
    (["--target", "tpu"], "--target must be cuda or cpu"),
    (["--ca-cert", "/nonexistent/ca.pem"], "--ca-cert /nonexistent/ca.pem: no such file"),
    (["--wheelhouse", "/nonexistent/wheels"], "--wheelhouse /nonexistent/wheels: no such folder"),
])
def test_docker_build_usage_errors(args, message):
    res = subprocess.run(["bash", str(REPO / "scripts" / "docker_build.sh"), "--print", *args],
                         capture_output=True, text=True)
    assert res.returncode == 2 and message in res.stderr and not res.stdout, res.stderr


@pytest.mark.parametrize("base", base_names())
@pytest.mark.parametrize("target", ["cuda", "cpu"])
def test_docker_build_labels_carry_every_pin_and_the_patch_list(target, base):
    cmd = _build_command("--target", target, "--base", base, "--base-image", "example/base@sha256:" + "0" * 64)
    assert cmd[:2] == ["docker", "build"] and cmd[-1] == str(REPO)
    labels = dict(cmd[i + 1].split("=", 1) for i, w in enumerate(cmd) if w == "--label")
    build_args = dict(cmd[i + 1].split("=", 1) for i, w in enumerate(cmd) if w == "--build-arg")
    assert build_args["TARGET"] == target and labels["kvstack.target"] == target
    assert build_args["KVSTACK_BASE"] == base and labels["kvstack.base"] == base
    assert build_args[f"{target.upper()}_BASE_IMAGE"].endswith("0" * 64)
    assert labels["org.opencontainers.image.base.name"].startswith("example/base@sha256:")
    pin_labels = {k for k in labels if k.startswith("kvstack.pin.")}
    want_labels = set()
    for comp in COMPONENTS:
        for key, value in load_pin(comp, base).values.items():
            want_labels.add(f"kvstack.pin.{comp}.{key.lower().replace('_', '-')}")
            assert labels[f"kvstack.pin.{comp}.{key.lower().replace('_', '-')}"] == value
    assert pin_labels == want_labels, "only the chosen base's pins"
    patches = json.loads(labels["kvstack.patches"])
    want = [(c, p.name) for c in COMPONENTS for p in read_series(load_pin(c, base).series_dir)]
    assert [(p["component"], p["patch"]) for p in patches] == want
    assert all(p["upstream_status"] != "unknown" for p in patches)
    assert labels["kvstack.patches.count"] == str(len(want))
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode == 0:
        assert labels["org.opencontainers.image.revision"].startswith(head.stdout.strip())
        assert build_args["KVSTACK_REVISION"] == labels["org.opencontainers.image.revision"]


def test_patch_label_reports_upstream_status(tmp_path, monkeypatch):
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import image_labels
    finally:
        sys.path.pop(0)
    patch = tmp_path / "0001-demo.patch"
    patch.write_text("From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001\n"
                     "From: t <t@localhost>\nDate: Sat, 1 Jan 2000 00:00:00 +0000\n"
                     "Subject: [PATCH 1/2] demo: a change\n\nWhy.\n\n"
                     "Upstream-Status: Submitted [vllm-project/vllm#42620]\nDrop-When: never\n---\n"
                     "diff --git a/vllm/x.py b/vllm/x.py\n")
    monkeypatch.setattr(image_labels, "read_series", lambda d: [patch] if d.name == "vllm" else [])
    lab = image_labels.labels("cuda", "abc", "src", image_labels.patch_list())
    assert lab["kvstack.base"] == default_base()
    assert json.loads(lab["kvstack.patches"]) == [
        {"component": "vllm", "patch": "0001-demo.patch", "subject": "demo: a change",
         "upstream_status": "Submitted [vllm-project/vllm#42620]"}]
    assert lab["kvstack.patches.count"] == "1"


def test_hadolint_clean():
    res = subprocess.run(["bash", str(REPO / "ci" / "hadolint.sh")], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
