"""--gpu-memory-utilization: each process's share of a GPU (the single-GPU disaggregated mode)."""
import pytest
import torch

from splitserve.engine.config import EngineConfig
from splitserve.engine.gpu_memory import GIB, kv_blocks_for_budget
from splitserve.cli.up import memory_shares


def test_the_pool_gets_the_share_minus_what_the_process_already_holds():
    # 0.3 of 140 GiB = 42 GiB; 2 GiB of weights, a step and the context leave 40 GiB of 1 MiB pages.
    assert kv_blocks_for_budget(140 * GIB, 0.3, 2 * GIB, 1 << 20) == 40 * 1024
    assert kv_blocks_for_budget(140 * GIB, 0.3, 2 * GIB, 1 << 20, free_bytes=100 * GIB) == 40 * 1024


def test_a_share_too_small_or_a_gpu_too_full_is_a_clear_error():
    with pytest.raises(ValueError, match="no room for a KV pool; raise it"):
        kv_blocks_for_budget(16 * GIB, 0.05, 1 * GIB, 1 << 20)
    with pytest.raises(ValueError, match="other processes use more than their share"):
        kv_blocks_for_budget(140 * GIB, 0.6, 2 * GIB, 1 << 20, free_bytes=30 * GIB)


@pytest.mark.parametrize("value", [0.0, -0.1, 1.01])
def test_config_refuses_a_share_outside_0_1(value):
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        EngineConfig(gpu_memory_utilization=value)


def test_a_cpu_engine_refuses_it(tiny_model_dirs):
    from splitserve.engine import LLM
    with pytest.raises(ValueError, match="kv_cache_memory_gb"):
        LLM(model=str(tiny_model_dirs["llama"]), device="cpu", dtype="float32", enforce_eager=True,
            gpu_memory_utilization=0.5)


def test_up_gives_decode_workers_twice_a_prefill_workers_share():
    assert memory_shares(0.9, 1, 1) == pytest.approx({"prefill": 0.3, "decode": 0.6})
    shares = memory_shares(0.9, 2, 3)
    assert 2 * shares["prefill"] + 3 * shares["decode"] == pytest.approx(0.9)
    assert memory_shares(0.8, 0, 0) == {"both": 0.8}
    with pytest.raises(SystemExit):
        memory_shares(1.5, 1, 1)


def test_up_hands_each_worker_its_share(tmp_path):
    from splitserve.cli.commands import parse
    from splitserve.cli.up import plan
    args = parse(["up", "--device", "cuda", "--prefill", "2", "--decode", "1", "--gpu-memory-utilization", "0.8"])
    shares = {}
    for spec in plan(args, "redis://127.0.0.1:1/0", str(tmp_path)):
        if spec.name not in ("redis", "gateway"):
            argv = spec.argv
            shares[spec.name] = float(argv[argv.index("--gpu-memory-utilization") + 1])
            assert argv.count("--gpu-memory-utilization") == 1
    assert shares == pytest.approx({"prefill0": 0.2, "prefill1": 0.2, "decode0": 0.4})
    assert sum(shares.values()) == pytest.approx(0.8)


def test_up_on_cpu_refuses_a_gpu_share():
    from splitserve.cli.commands import parse
    from splitserve.cli.up import cmd_up
    with pytest.raises(SystemExit, match="shares a GPU"):
        cmd_up(parse(["up", "--device", "cpu", "--gpu-memory-utilization", "0.5"]))


@pytest.mark.gpu
def test_a_cuda_engine_stays_inside_its_share(tiny_model_dirs):
    from splitserve.engine import LLM, SamplingParams
    total = torch.cuda.get_device_properties(0).total_memory
    llm = LLM(model=str(tiny_model_dirs["llama"]), device="cuda", dtype="float32", enforce_eager=True,
              gpu_memory_utilization=0.1)
    llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    runner = llm.engine.runner
    assert runner.num_blocks * runner.kv_cache[:, :, 0].numel() * runner.kv_cache.element_size() > 0.05 * total
    assert torch.cuda.memory_reserved(runner.device) <= 0.1 * total
