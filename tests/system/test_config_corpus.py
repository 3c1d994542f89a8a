"""Every invalid config in ``tests/corpus`` is refused by the real CLI, with its exact lines.

Each case is one YAML file whose leading comments say what the operator must
see: ``# expect: LINE`` (one per stderr line, in order, ``{file}`` standing for
the path passed to ``--config``) and optionally ``# env: NAME=value``. The
CLI runs in a subprocess, as an operator runs it, in a copy of the corpus
folder so that ``callable: corpus_sweeps:purge`` finds the helper modules and
every location is a short relative path.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
CORPUS = REPO / "tests" / "corpus"
CASES = sorted(CORPUS.glob("*.yaml"))

# Written at test time: a .py file that does not parse cannot live in the tree,
# where ruff and mypy read every file.
SYNTAX_ERROR_MODULE = '''"""A module with a syntax error, as a half-typed edit leaves one."""

def purge(ctx:
    pass
'''


def read_header(case: Path) -> tuple[list[str], dict[str, str]]:
    """The ``# expect:`` lines and ``# env:`` variables of a case's leading comments."""
    expected: list[str] = []
    env: dict[str, str] = {}
    for line in case.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        if line.startswith("# expect: "):
            expected.append(line.removeprefix("# expect: ").replace("{file}", case.name))
        elif line.startswith("# env: "):
            name, _, value = line.removeprefix("# env: ").partition("=")
            env[name] = value
    return expected, env


def check_config(config: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """Run ``sweepd check-config --no-db`` with no SWEEPD_* variable but ``env``'s."""
    clean = {name: value for name, value in os.environ.items() if not name.startswith("SWEEPD_")}
    return subprocess.run(
        [sys.executable, "-m", "sweepd", "check-config", "--no-db", "--config", config],
        cwd=cwd,
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the corpus, plus the module that does not parse."""
    folder = tmp_path_factory.mktemp("corpus") / "corpus"
    shutil.copytree(CORPUS, folder, ignore=shutil.ignore_patterns("__pycache__"))
    (folder / "corpus_syntax.py").write_text(SYNTAX_ERROR_MODULE, encoding="utf-8")
    return folder


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.stem)
def test_invalid_config_is_refused_with_located_lines(case: Path, workdir: Path) -> None:
    expected, env = read_header(case)
    result = check_config(case.name, workdir, env)
    assert "Traceback" not in result.stdout + result.stderr, result.stderr
    assert (result.returncode, result.stdout, result.stderr.splitlines()) == (2, "", expected)


def test_corpus_is_large_and_every_case_expects_something() -> None:
    assert len(CASES) >= 30
    assert [case.name for case in CASES if not read_header(case)[0]] == []


def test_example_config_is_valid() -> None:
    result = check_config("config.example.yaml", REPO, {})
    assert "Traceback" not in result.stdout + result.stderr, result.stderr
    assert (result.returncode, result.stderr) == (0, "")
