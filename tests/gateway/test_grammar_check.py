"""The gateway's structured-output check runs in a child process: refusals name the field, a spec
that compiles too long is refused and the child replaced, answers are remembered."""
import asyncio
import json

import pytest

from splitserve.common.errors import InvalidArgument
from splitserve.engine.structured_output import StructuredOutput
from splitserve.gateway.grammar_check import GrammarChecker


def nested_arrays(depth: int) -> str:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return json.dumps(schema)


def run(coro):
    return asyncio.run(coro)


def test_a_valid_spec_passes_and_a_bad_one_is_refused_naming_the_field():
    async def go():
        checker = GrammarChecker()
        try:
            await checker.check(StructuredOutput(json_schema='{"type": "object", "properties": {"a": {"type": "integer"}}}'))
            await checker.check(StructuredOutput(choice=("yes", "no")))
            with pytest.raises(InvalidArgument, match=r"^sampling\.structured_output\.regex is not supported"):
                await checker.check(StructuredOutput(regex="(unclosed"))
            return checker._proc.pid
        finally:
            await checker.close()
    assert run(go()) > 0


def test_answers_are_remembered_and_the_oldest_forgotten():
    async def go():
        checker = GrammarChecker(cache_size=2)
        asked = []
        ask = checker._ask

        async def counting(spec):
            asked.append(spec.key)
            return await ask(spec)
        checker._ask = counting
        try:
            a, b, c = (StructuredOutput(regex=r) for r in ("a+", "b+", "c+"))
            for spec in (a, a, b, a, c, b, a):
                await checker.check(spec)
            bad = StructuredOutput(regex="[")
            for _ in range(2):
                with pytest.raises(InvalidArgument):
                    await checker.check(bad)
        finally:
            await checker.close()
        return asked
    # a, b asked; c pushes out b (a was used last); b asked again, which pushes out a; then a again.
    assert run(go()) == [("regex", "a+"), ("regex", "b+"), ("regex", "c+"), ("regex", "b+"), ("regex", "a+"),
                         ("regex", "[")]


def test_a_spec_that_compiles_too_long_is_refused_and_the_next_one_checked_by_a_new_child():
    async def go():
        checker = GrammarChecker(timeout_s=0.5)
        try:
            await checker.check(StructuredOutput(regex="warm-up"))
            first = checker._proc.pid
            with pytest.raises(InvalidArgument, match=r"json_schema is too complex: it did not compile within 0\.5 s"):
                await checker.check(StructuredOutput(json_schema=nested_arrays(400)))
            assert checker._proc is None  # killed, not left compiling
            await checker.check(StructuredOutput(regex="[0-9]+"))
            return first, checker._proc.pid
        finally:
            await checker.close()
    first, second = run(go())
    assert first != second
