"""bench/ stands on its own: of tests/ it imports only the harness (tests/harness: stacks,
tiny models, Redis, prompts; never a test module), and its modules import each other without
a cycle."""
import ast
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


def test_bench_imports_nothing_from_tests_and_has_no_cycle():
    modules = {p.stem: imports(p) for p in BENCH.glob("*.py")}
    assert modules, "no benchmark found"
    from_tests = {name: sorted(m for m in deps if (m == "tests" or m.startswith("tests."))
                               and m != "tests.harness" and not m.startswith("tests.harness."))
                  for name, deps in modules.items()}
    assert not any(from_tests.values()), from_tests
    graph = {name: {m.split(".")[1] for m in deps if m.startswith("bench.")} for name, deps in modules.items()}

    def cycle_from(name, path):
        for dep in graph.get(name, ()):
            if dep in path:
                return path[path.index(dep):] + [dep]
            found = cycle_from(dep, path + [dep])
            if found:
                return found
        return None
    cycles = [c for c in (cycle_from(n, [n]) for n in graph) if c]
    assert not cycles, cycles
