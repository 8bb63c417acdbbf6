"""bench/gpu_session.sh, without a GPU: its dry stage proves the set-up every GPU stage does
(the checkout imported as spmd_runtime through a link, carried wheels installed offline), and
its suite chunks cover every test file exactly once."""
from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from collections import Counter
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "gpu_session.sh"


def _env(tmp_path: Path) -> dict[str, str]:
    """This interpreter as the device's python3; every folder the script writes under tmp_path;
    nothing carried from the checkout (its .whl/ and .gpu/, if any, are a session's own). A
    PYTHONPATH given to pytest (a GPU session's own set-up, carrying packages) stays, less the
    checkout: the script must put that on the path itself."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "PYTHONPATH"))}
    given = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
             if p and Path(p).resolve() != REPO]
    if given:
        env["PYTHONPATH"] = os.pathsep.join(given)
    return dict(env, PYTHON=sys.executable, OUT=str(tmp_path / "out"),
                GPU_TMP=str(tmp_path / "gpu"), CARRIED=str(tmp_path / "carry"))


def _wheel(folder: Path, distribution: str, files: dict[str, str]) -> Path:
    """A wheel of `distribution` 0.0.1 holding `files` (path: text), which no python has."""
    folder.mkdir(parents=True, exist_ok=True)
    name = distribution.replace("-", "_")
    info = f"{name}-0.0.1.dist-info"
    files = {**files,
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {distribution}\nVersion: 0.0.1\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                              "Tag: py3-none-any\n"}
    files[f"{info}/RECORD"] = "".join(f"{path},,\n" for path in [*files, f"{info}/RECORD"])
    wheel = folder / f"{name}-0.0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, text in files.items():
            archive.writestr(path, text)
    return wheel


def _script(tmp_path: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=tmp_path, env=_env(tmp_path),
                          capture_output=True, text=True, stdin=subprocess.DEVNULL,
                          timeout=timeout)


@pytest.mark.timeout(300)
def test_the_dry_stage_proves_the_set_up_of_the_gpu_stages(tmp_path: Path) -> None:
    _wheel(tmp_path / "carry" / ".whl", "spmd-gpu-probe",
           {"spmd_gpu_probe/__init__.py": "CARRIED = True\n"})
    result = _script(tmp_path, "dry", timeout=240)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    site = tmp_path / "gpu" / "site"
    assert (site / "spmd_runtime").resolve() == REPO, "the namespace is the checkout itself"
    assert f"import check: spmd_runtime.launch.cli and .worker_proc.worker through {site}" in output
    assert "this python lacks 1 of them" in output
    assert (site / "spmd_gpu_probe" / "__init__.py").is_file(), "the carried wheel is installed"
    assert "dry-cli-help: exit 0" in output and "dry-collect: exit 0" in output
    assert " tests collected" in output and "dry: set-up proven" in output
    for step in ("dry-imports", "dry-cli-help", "dry-collect"):
        assert (tmp_path / "out" / f"{step}.log").is_file()


@pytest.mark.timeout(300)
def test_the_dry_stage_fails_when_a_carried_package_does_not_import(tmp_path: Path) -> None:
    _wheel(tmp_path / "carry" / ".gpu" / "suite", "broken-zmq",
           {"zmq/__init__.py": "raise ImportError('this zmq is broken')\n"})
    result = _script(tmp_path, "dry", timeout=240)
    assert result.returncode == 1, result.stdout[-4000:]
    assert "this zmq is broken" in result.stdout
    assert "dry-imports: exit 1" in result.stdout and "dry: FAILED" in result.stdout
    assert "dry-collect: skipped (the imports failed)" in result.stdout


@pytest.mark.parametrize("count", [None, "3"])
def test_the_suite_chunks_cover_every_test_file_once(tmp_path: Path, count: str | None) -> None:
    result = _script(tmp_path, "suite-list", *([count] if count else []))
    assert result.returncode == 0, result.stderr
    rows = [line.split("\t") for line in result.stdout.splitlines()]
    listed = Counter(file for _, file in rows)
    on_disk = {path.relative_to(REPO).as_posix() for path in (REPO / "tests").rglob("test_*.py")}
    assert set(listed) == on_disk and set(listed.values()) == {1}
    sizes = Counter(int(number) for number, _ in rows)
    assert sorted(sizes) == list(range(1, int(count or 4) + 1))
    assert max(sizes.values()) - min(sizes.values()) <= 1, sizes
    assert "tests/launch/test_gpu_session.py" in listed


def test_a_chunk_out_of_range_is_refused_before_any_set_up(tmp_path: Path) -> None:
    result = _script(tmp_path, "suite", "5", "4")
    assert result.returncode == 2
    assert "there is no chunk 5 of 4" in result.stderr
    assert not (tmp_path / "gpu").exists()
