"""bench/idle_memory.py end to end on a small buffer: one figure per page size and idle time."""
import json

from bench.idle_memory import buffer, main
from splitserve.common.huge_pages import thp_available


def test_a_small_run_writes_every_figure(tmp_path):
    out = tmp_path / "idle.json"
    assert main(["--mib", "8", "--idle", "0.01,0.05", "--rounds", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["pages"]) == ({"4k", "2m"} if thp_available() else {"4k"})
    for figures in result["pages"].values():
        assert figures["warm_ms"] > 0 and set(figures["after_idle_ms"]) == {"0.01", "0.05"}
        assert all(ms > 0 for ms in figures["after_idle_ms"].values())


def test_the_buffer_is_filled_and_starts_on_a_huge_page_boundary():
    tensor = buffer(4, huge=False)
    assert tensor.numel() == (4 << 20) // 4 and float(tensor.sum()) == tensor.numel()
    assert tensor.data_ptr() % (2 << 20) == 0
