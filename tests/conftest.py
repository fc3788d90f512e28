import copy
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The tests spawn processes (subprocess with a preexec_fn forks) from a process that runs gRPC.
# With gRPC's fork support on, its poller thread restarts in the forked child and can abort it
# on the parent's closed epoll fd before exec (grpc/grpc#43055); the child needs none of it.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
# Worker processes the tests start run eager: compiling the step takes seconds per process and
# says nothing about serving; the engine tests compile it where it is what they check.
os.environ.setdefault("SPLITSERVE_ENFORCE_EAGER", "1")
# Compiled steps here keep inductor's Python wrapper: its C++ one (the engine's default on a CPU,
# splitserve/engine/compiled_forward.py) adds ~26 s to each cold compile of a 30-layer model, paid
# by every SmolLM2 test on a fresh machine. The engine's oracle tests, on 2-layer models where it
# costs nothing, run under it (``step_mode``).
os.environ.setdefault("TORCHINDUCTOR_CPP_WRAPPER", "0")

from splitserve.engine.openmp import prefer_passive_waiting  # noqa: E402

# Before torch loads, and inherited by every process the tests start: many of them share 2 cores.
prefer_passive_waiting()
# For the same reason the workers the tests start leave their torch threads to the scheduler
# (--no-thread-binding): two test processes' engines bound to the same cores could not move to a
# core another test leaves idle. tests/test_openmp_handover.py binds a team on purpose.
os.environ.setdefault("SPLITSERVE_NO_THREAD_BINDING", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

# Triton reads this when it is imported (transformers imports it below): without a GPU its kernels
# can only run interpreted on CPU tensors; with one they are compiled (TRITON_INTERPRET=1 exported
# still interprets them).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.harness import file_seconds  # noqa: E402
from tests.harness.tiny_models import make_tiny_model  # noqa: E402


# Tests that start processes of their own (a stack, tensor-parallel ranks, a transfer peer, a
# linter): every test under these directories, and these modules. `make test-quick` leaves them
# out (pytest -m "not processes and not slow").
PROCESS_DIRS = {"service", "faults", "bench", "deploy"}
PROCESS_MODULES = {"test_tensor_parallel", "test_kvtransfer_handoff", "test_kvtransfer_nccl", "test_kvtransfer_tcp",
                   "test_tp_all_reduce", "test_openmp_handover", "test_layers", "test_docs"}
# What a test file that starts processes and has no recorded time is taken to last (one stack's
# start and a few requests).
UNRECORDED_PROCESS_FILE_S = 10.0


def pytest_collection_modifyitems(config, items):
    root = Path(__file__).parent
    for item in items:
        path = Path(item.fspath).relative_to(root)
        if path.parts[0] in PROCESS_DIRS or path.stem in PROCESS_MODULES:
            item.add_marker(pytest.mark.processes)
    # The longest files first (a stable sort keeps each file's tests together and in order): under
    # `make test`'s `-n 2 --dist loadfile --no-loadscope-reorder` the long files are shared out
    # while the short ones are still pending, instead of one process finishing a long file alone
    # at the end. Seconds as recorded (tests/harness/file_seconds.py); a file not recorded yet
    # counts as a typical stack's start if it starts processes, else as nothing.
    seconds = file_seconds.load()

    def expected_s(item) -> float:
        path = Path(item.fspath).relative_to(root.parent).as_posix()
        return seconds.get(path, UNRECORDED_PROCESS_FILE_S if item.get_closest_marker("processes") else 0.0)

    items.sort(key=lambda item: -expected_s(item))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-models")
    return {arch: make_tiny_model(root / arch, arch=arch) for arch in ("llama", "qwen2", "mistral")}


@pytest.fixture(params=["eager", "compiled"])
def step_mode(request, monkeypatch) -> dict:
    """Engine arguments for each way a step can run: op by op, and as one compiled graph (with
    inductor's C++ wrapper, as the engine runs it on a CPU outside the tests)."""
    if request.param == "compiled":
        monkeypatch.setenv("TORCHINDUCTOR_CPP_WRAPPER", "1")
    return {"enforce_eager": request.param == "eager"}


@pytest.fixture
def make_llm():
    """Builds LLMs and, after the test, checks each is idle: no request left, every page free or cached."""
    from splitserve.engine import LLM
    made = []

    def factory(model, **kwargs):
        kwargs.setdefault("dtype", "float32")
        kwargs.setdefault("enforce_eager", True)
        llm = LLM(model=str(model), **kwargs)
        made.append(llm)
        return llm

    yield factory
    for llm in made:
        llm.engine.assert_idle()


class HFReference:
    """Greedy `transformers.generate` in fp32, memoised: the correctness oracle."""

    def __init__(self, model_dir: Path):
        from transformers import AutoModelForCausalLM
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self._memo: dict[tuple, list[int]] = {}

    def greedy(self, prompt: list[int], max_tokens: int, ignore_eos: bool = True) -> list[int]:
        key = (tuple(prompt), max_tokens, ignore_eos)
        if key not in self._memo:
            config = copy.deepcopy(self.model.generation_config)
            if ignore_eos:
                # Keep going past EOS without masking it, as the engine's ignore_eos does:
                # an id outside the vocabulary never stops generation.
                config.eos_token_id = self.model.config.vocab_size
            config.pad_token_id = config.pad_token_id if config.pad_token_id is not None else 0
            with torch.no_grad():
                out = self.model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                          generation_config=config, max_new_tokens=max_tokens, do_sample=False)
            self._memo[key] = out[0, len(prompt):].tolist()
        return self._memo[key]

    def agrees(self, prompt: list[int], tokens: list[int], tie: float = 1e-4) -> bool:
        """``tokens`` is a greedy continuation of ``prompt``: the oracle's, except where the oracle's two
        best next tokens are within ``tie`` of each other and ``tokens`` took the other one (a tie
        that the summation order of another batch breaks the other way; fp32 moves a logit by
        ~1e-6), and from there the greedy continuation of what was taken. For tests whose batches
        vary from run to run (hundreds of requests at once); the others compare exactly."""
        expected = self.greedy(prompt, len(tokens))
        j = next((i for i, (a, b) in enumerate(zip(tokens, expected)) if a != b), None)
        if j is None:
            return len(tokens) == len(expected)
        with torch.no_grad():
            logits = self.model(torch.tensor([prompt + tokens[:j]])).logits[0, -1]
        if (logits[expected[j]] - logits[tokens[j]]).item() > tie:
            return False
        return self.agrees(prompt + tokens[:j + 1], tokens[j + 1:], tie)


@pytest.fixture(scope="session")
def llama_reference(tiny_model_dirs, hf_reference):
    """transformers' greedy output on the tiny Llama the service tests serve."""
    return hf_reference(tiny_model_dirs["llama"])


@pytest.fixture(scope="session")
def hf_reference():
    refs: dict[str, HFReference] = {}

    def get(model_dir: Path) -> HFReference:
        if str(model_dir) not in refs:
            refs[str(model_dir)] = HFReference(model_dir)
        return refs[str(model_dir)]

    return get


@pytest.fixture
def children_left():
    """The processes this test started that are still alive when it calls this (children of
    this pytest process that a longer-lived fixture, or another test, did not start before it)."""
    import psutil
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    return lambda: [p for p in me.children(recursive=True) if p.pid not in before]


@pytest.fixture
def private_shm(monkeypatch):
    """A shared-memory directory of this test's own (SPLITSERVE_SHM_DIR, which the processes it
    starts inherit): what its pools leave behind is there, apart from other tests' running beside it."""
    import shutil
    import uuid
    root = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(os.environ.get("TMPDIR", "/tmp"))
    directory = root / f"splitserve-test-{uuid.uuid4().hex[:8]}"
    directory.mkdir()
    monkeypatch.setenv("SPLITSERVE_SHM_DIR", str(directory))
    yield directory
    shutil.rmtree(directory, ignore_errors=True)
