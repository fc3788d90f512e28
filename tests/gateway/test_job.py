"""The gateway's Job: one owner of a request's end. Whoever calls ``finish`` first decides the
outcome; every later call changes nothing (no process needed: the job is driven by hand)."""
import asyncio

import grpc

from splitserve.engine.sampling_params import SamplingParams
from splitserve.gateway.detokenizer import TextStream
from splitserve.gateway.job import Finished, Job, JobState, Tokens, cancelled
from tests.harness.tiny_models import byte_tokenizer


def make_job(ended: list, stop=(), max_tokens=8, text=True) -> Job:
    tokenizer = byte_tokenizer()
    prompt = tokenizer.encode("hello")
    params = SamplingParams(max_tokens=max_tokens, stop=list(stop))
    return Job("r1", prompt, params, priority=0, arrival_s=0.0, deadline=None, on_finish=ended.append,
               text=TextStream(tokenizer, prompt, list(stop)) if text else None)


def drain(job: Job) -> list:
    events = []
    while not job.events.empty():
        events.append(job.events.get_nowait())
    return events


def test_the_first_finish_wins_and_every_later_one_changes_nothing():
    ended = []
    job = make_job(ended)
    job.emit([72, 105], [])
    assert job.finish(Finished("length"))
    assert not job.finish(cancelled("client went away"))
    assert not job.finish(Finished("error", grpc.StatusCode.UNAVAILABLE, "late"))
    job.emit([33], [])  # a worker's late tokens go nowhere
    events = drain(job)
    assert [type(e) for e in events] == [Tokens, Finished] and events[1] == Finished("length")
    assert ended == [job] and job.state is JobState.FINISHED and job.generated == [72, 105]
    assert job.terminal_fields()["finish_reason"] == "length" and job.terminal_fields()["completion_tokens"] == 2
    assert job.outcome.terminal_state == "finished" and cancelled().terminal_state == "aborted"


def test_a_stop_string_ends_the_request_before_the_workers_own_end():
    ended = []
    job = make_job(ended, stop=["lo"])
    ids = byte_tokenizer().encode("hello")  # one token per character
    for token in ids:  # "hello": the stop string completes with the last one
        job.emit([token], [])
    assert not job.finish(Finished("length"))  # the workers' end comes after it: too late
    events = drain(job)
    assert events[-1] == Finished("stop") and ended == [job]
    assert "".join(e.text for e in events if isinstance(e, Tokens)) + job.text.finish() == "hel"
    assert job.text.matched == "lo"


def test_finish_cancels_the_attempt_running_on_the_workers():
    async def main():
        ended = []
        job = make_job(ended)
        started, cleaned_up = asyncio.Event(), asyncio.Event()

        async def attempt():
            started.set()
            try:
                await asyncio.sleep(60)
            finally:
                cleaned_up.set()  # where an attempt aborts the request on its workers
        job.task = asyncio.get_running_loop().create_task(attempt())
        await started.wait()
        job.finish(cancelled("client went away"))
        await asyncio.wait_for(cleaned_up.wait(), 5)
        assert job.task.cancelled() and ended == [job]
    asyncio.run(main())


def test_an_attempt_that_ends_the_job_is_not_cancelled_by_it():
    async def main():
        ended = []
        job = make_job(ended)

        async def attempt():
            job.finish(Finished("eos"))  # the workers' stream reached its end
            await asyncio.sleep(0)
            return "went on"
        job.task = asyncio.get_running_loop().create_task(attempt())
        assert await job.task == "went on" and ended == [job]
    asyncio.run(main())


def test_resume_inputs_continue_after_the_streamed_tokens():
    ended = []
    job = make_job(ended, max_tokens=5, text=False)
    job.params = SamplingParams(max_tokens=5, min_tokens=3, seed=7)
    assert job.resume_inputs() == (job.prompt_token_ids, job.params)
    job.emit([1, 2], [])
    prompt, params = job.resume_inputs()
    assert prompt == job.prompt_token_ids + [1, 2]
    assert (params.max_tokens, params.min_tokens, params.seed) == (3, 1, 7)
    job.emit([3, 4, 5], [])
    assert job.resume_inputs() is None  # every token was out: nothing left to generate
