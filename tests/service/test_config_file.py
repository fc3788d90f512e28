"""`--config FILE`: one YAML file configures up, the gateway and the workers; the command line and
SPLITSERVE_* variables override it; a key no command takes is an error that names the file."""
import subprocess
import sys

import pytest

from splitserve.cli import config_file
from splitserve.cli.commands import parse
from splitserve.cli.up import plan


@pytest.fixture
def tuned(tmp_path):
    path = tmp_path / "tuned.yaml"
    path.write_text(config_file.dump({"max_num_seqs": 12, "max-num-batched-tokens": 768, "block_size": 32,
                                      "prefill": 1, "decode": 2, "prefill_threads": 1, "decode_threads": 3,
                                      "queue_limit": 99, "enable_prefix_caching": False},
                                     header="written by a test\n\nsecond paragraph"))
    return path


def test_every_process_takes_its_keys_from_one_file(tuned):
    assert tuned.read_text().startswith("# written by a test\n#\n# second paragraph\n")
    up = parse(["up", "--config", str(tuned)])
    assert (up.max_num_seqs, up.max_num_batched_tokens, up.block_size, up.prefill, up.decode) == (12, 768, 32, 1, 2)
    assert up.enable_prefix_caching is False and up.queue_limit == 99
    decode = parse(["decode", "--config", str(tuned)])
    assert (decode.max_num_seqs, decode.block_size) == (12, 32) and not hasattr(decode, "queue_limit")
    gateway = parse(["gateway", "--config", str(tuned)])
    assert (gateway.queue_limit, gateway.block_size) == (99, 32) and not hasattr(gateway, "max_num_seqs")


def test_command_line_then_environment_then_file_then_default(tuned, monkeypatch):
    assert parse(["decode", "--config", str(tuned), "--max-num-seqs", "5"]).max_num_seqs == 5
    monkeypatch.setenv("SPLITSERVE_MAX_NUM_SEQS", "7")
    assert parse(["decode", "--config", str(tuned)]).max_num_seqs == 7
    assert parse(["decode", "--config", str(tuned), "--max-num-seqs", "5"]).max_num_seqs == 5
    monkeypatch.delenv("SPLITSERVE_MAX_NUM_SEQS")
    monkeypatch.setenv("SPLITSERVE_CONFIG", str(tuned))  # the file itself from the environment
    assert parse(["decode"]).max_num_seqs == 12
    monkeypatch.delenv("SPLITSERVE_CONFIG")
    assert parse(["decode"]).max_num_seqs == 64  # EngineConfig's default


def test_up_hands_the_file_values_to_its_children(tuned):
    args = parse(["up", "--config", str(tuned)])
    specs = {s.name: s.argv for s in plan(args, "redis://127.0.0.1:1/0", "/tmp")}
    assert set(specs) == {"redis", "gateway", "prefill0", "decode0", "decode1"}

    def flag(argv, name):
        return argv[argv.index(name) + 1]
    assert flag(specs["decode1"], "--max-num-seqs") == "12" and flag(specs["prefill0"], "--block-size") == "32"
    assert flag(specs["prefill0"], "--num-threads") == "1" and flag(specs["decode0"], "--num-threads") == "3"
    assert "--no-enable-prefix-caching" in specs["decode0"] and flag(specs["gateway"], "--queue-limit") == "99"


@pytest.mark.parametrize("text, message", [
    ("max_num_seq: 4\n", "no splitserve flag is called max_num_seq (did you mean max_num_seqs?)"),
    ("- 1\n- 2\n", "must hold a mapping of flag names to values"),
    ("block_size: [1, 2]\n", "block_size must be a single value"),
    ("block_size: 3\n", "block_size must be a power of two"),
    ("max_num_seqs: many\n", "'many' is not a valid integer"),
    ("a: b: c\n", "is not valid YAML"),
])
def test_a_bad_file_is_a_usage_error_that_says_what_is_wrong(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    out = subprocess.run([sys.executable, "-m", "splitserve.cli", "decode", "--config", str(path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and message in " ".join(out.stderr.split()), out.stderr
