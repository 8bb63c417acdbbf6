"""The Python side of bench/gpu_session.sh: which carried wheels the device lacks, which test
files each chunk of the suite stage runs, and the check that the set-up imports what it should.

    python3 bench/gpu_session.py lacking WHEEL...   # the wheels whose distribution is not installed
    python3 bench/gpu_session.py chunk N K          # the test files of chunk N of K, one a line
    python3 bench/gpu_session.py chunks K           # "N<TAB>file" for every chunk of K
    python3 bench/gpu_session.py imports SITE       # after the set-up: spmd_runtime comes via SITE
"""
from __future__ import annotations

import argparse
import importlib.metadata
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def wheel_distribution(wheel: Path) -> str:
    """A wheel file's distribution name, normalized (PEP 427 names it name-version-tags.whl)."""
    return re.sub(r"[-_.]+", "-", wheel.name.split("-")[0]).lower()


def lacking(wheels: list[Path]) -> list[Path]:
    """The wheels whose distribution this interpreter does not have. Only those are installed,
    so a package the device has already (numpy, httpx, pytest ...) is never shadowed by ours."""
    missing = []
    for wheel in wheels:
        try:
            importlib.metadata.distribution(wheel_distribution(wheel))
        except importlib.metadata.PackageNotFoundError:
            missing.append(wheel)
    return missing


def test_files(root: Path = REPO) -> list[str]:
    """Every test file under tests/ (pytest's test_*.py), sorted, relative to the checkout."""
    return sorted(path.relative_to(root).as_posix() for path in (root / "tests").rglob("test_*.py"))


def chunk(files: list[str], number: int, count: int) -> list[str]:
    """Chunk `number` (1 to count) of `count`: every count-th file from the number-th. Each chunk
    gets its share of every folder, so the slow engine tests of tests/runtime/ spread evenly."""
    if count < 1:
        raise ValueError(f"the suite splits into one chunk or more, not {count}")
    if not 1 <= number <= count:
        raise ValueError(f"there is no chunk {number} of {count}: chunks are numbered 1 to {count}")
    return files[number - 1::count]


def check_imports(site: Path) -> str:
    """What the stages import, imported: the engine's entry points through the link
    site/spmd_runtime (the checkout) and the carried packages. ImportError or RuntimeError
    says what is missing or where it came from instead."""
    import gguf  # noqa: F401
    import msgspec  # noqa: F401
    import spmd_runtime.launch.cli as cli
    import spmd_runtime.worker_proc.worker  # noqa: F401
    import zmq  # noqa: F401

    link = site / "spmd_runtime"
    if not Path(cli.__file__).is_relative_to(link):
        raise RuntimeError(f"spmd_runtime.launch.cli came from {cli.__file__}, not through {link}")
    found = ", ".join(f"{name} {importlib.metadata.version(name)}"
                      for name in ("pyzmq", "msgspec", "gguf"))
    return f"import check: spmd_runtime.launch.cli and .worker_proc.worker through {link}; {found}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("lacking").add_argument("wheels", nargs="*", type=Path)
    one = commands.add_parser("chunk")
    one.add_argument("number", type=int)
    one.add_argument("count", type=int)
    commands.add_parser("chunks").add_argument("count", type=int)
    commands.add_parser("imports").add_argument("site", type=Path)
    args = parser.parse_args(argv)
    if args.command == "imports":
        try:
            lines = [check_imports(args.site)]
        except (ImportError, RuntimeError) as error:
            print(f"import check failed: {error!r}", file=sys.stderr)
            return 1
    elif args.command == "lacking":
        lines = [str(wheel) for wheel in lacking(args.wheels)]
    else:
        numbers = [args.number] if args.command == "chunk" else range(1, max(args.count, 1) + 1)
        try:
            chunks = {number: chunk(test_files(), number, args.count) for number in numbers}
        except ValueError as error:
            parser.error(str(error))
        lines = chunks[args.number] if args.command == "chunk" else [
            f"{number}\t{file}" for number, files in chunks.items() for file in files]
    for line in lines:
        print(line)
    return 0

if __name__ == "__main__":
    raise SystemExit(main())
