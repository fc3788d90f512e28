"""OpenAI response bodies: completions and chat completions, whole or as stream chunks."""
from __future__ import annotations

import time
import uuid

from splitserve.gateway.job import Finished, Job
from splitserve.gateway.samples import SampleGroup

# Our finish reasons -> OpenAI's (a request that failed carries an error body instead).
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "tool_calls": "tool_calls"}


class Responses:
    """Builds the bodies of one request: its id, creation time and model are fixed at the start."""

    def __init__(self, chat: bool, model: str, tokenizer, request_id: str, token_ids: bool = False):
        """``token_ids``: every choice also carries its token ids (vLLM's ``return_token_ids``)."""
        self.chat = chat
        self.token_ids = token_ids
        self.model = model
        self.tokenizer = tokenizer
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{request_id}"
        self.created = int(time.time())
        # Completions' logprobs.text_offset counts the text of each choice sent so far.
        self.text_offsets: dict[int, int] = {}

    # ---- whole answers ------------------------------------------------------------------
    def whole(self, group: SampleGroup, answers: list["Answer"], ends: list[Finished]) -> dict:
        """The answer: one choice per sample, in index order."""
        choices = [self._choice(index, job, answers[index], ends[index]) for index, job in enumerate(group.jobs)]
        body = {**self._head(whole=True), "choices": choices, "usage": usage(group)}
        if self.token_ids:
            body["prompt_token_ids"] = list(group.leader.prompt_token_ids)
        return body

    def _choice(self, index: int, job: Job, answer: "Answer", finished: Finished) -> dict:
        reason = FINISH_REASONS.get(finished.finish_reason, finished.finish_reason)
        stop_reason = job.text.matched if job.text else None
        text, logprobs = "".join(answer.texts), answer.logprobs
        if self.chat:
            message = {"role": "assistant", "content": text}
            if answer.tool_calls:  # OpenAI: no content beside calls unless the model wrote some
                message["content"] = text if text.strip() else None
                message["tool_calls"] = [call.openai() for call in answer.tool_calls]
            if answer.reasoning:
                message["reasoning_content"] = "".join(answer.reasoning)
            choice = {"index": index, "message": message,
                      "logprobs": self.chat_logprobs(logprobs) if logprobs else None,
                      "finish_reason": reason, "stop_reason": stop_reason}
        else:
            choice = {"index": index, "text": text,
                      "logprobs": self.completion_logprobs(logprobs, index) if logprobs else None,
                      "finish_reason": reason, "stop_reason": stop_reason}
        if self.token_ids:
            choice["token_ids"] = list(job.generated)
        return choice

    # ---- stream chunks ------------------------------------------------------------------
    def chunk(self, text: str, logprobs: list, finish_reason: str | None = None, role: bool = False,
              with_usage: bool = False, token_ids: list[int] = (), index: int = 0, reasoning: str = "",
              tool_calls: list[dict] = ()) -> dict:
        """One stream chunk; ``tool_calls``: OpenAI's call deltas (``ToolCallPart.openai``)."""
        reason = FINISH_REASONS.get(finish_reason, finish_reason) if finish_reason else None
        if self.chat:
            delta = {"role": "assistant", "content": text} if role else ({"content": text} if text else {})
            if reasoning:
                delta["reasoning_content"] = reasoning
            if tool_calls:
                delta["tool_calls"] = list(tool_calls)
            choice = {"index": index, "delta": delta, "logprobs": self.chat_logprobs(logprobs) if logprobs else None,
                      "finish_reason": reason}
        else:
            choice = {"index": index, "text": text,
                      "logprobs": self.completion_logprobs(logprobs, index) if logprobs else None,
                      "finish_reason": reason}
        if self.token_ids:
            choice["token_ids"] = list(token_ids)
        body = {**self._head(whole=False), "choices": [choice]}
        if with_usage:
            body["usage"] = None  # stream_options.include_usage: null on every chunk but the last
        return body

    def usage_chunk(self, group: SampleGroup) -> dict:
        return {**self._head(whole=False), "choices": [], "usage": usage(group)}

    def _head(self, whole: bool) -> dict:
        kind = ("chat.completion" if whole else "chat.completion.chunk") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    # ---- logprobs -----------------------------------------------------------------------
    def _token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def chat_logprobs(self, entries: list) -> dict:
        """``{"content": [{token, logprob, bytes, top_logprobs}]}`` from ``TokenLogprobs`` protos."""
        def one(token_id: int, logprob: float) -> dict:
            token = self._token(token_id)
            return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}
        return {"content": [{**one(e.token_id, e.logprob), "top_logprobs": [one(t.token_id, t.logprob) for t in e.top]}
                            for e in entries]}

    def completion_logprobs(self, entries: list, index: int = 0) -> dict:
        """The legacy shape: parallel lists of tokens, their logprobs, top alternatives, text offsets."""
        tokens, logprobs, tops, offsets = [], [], [], []
        offset = self.text_offsets.get(index, 0)
        for e in entries:
            token = self._token(e.token_id)
            tokens.append(token)
            logprobs.append(e.logprob)
            tops.append({self._token(t.token_id): t.logprob for t in e.top} | {token: e.logprob})
            offsets.append(offset)
            offset += len(token)
        self.text_offsets[index] = offset
        return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}


class Answer:
    """What one sample has said so far (a whole answer is collected, then written at once)."""

    def __init__(self):
        self.texts: list[str] = []
        self.reasoning: list[str] = []
        self.logprobs: list = []
        self.tool_calls: list = []  # ToolCalls

    def add(self, tokens) -> None:
        self.texts.append(tokens.text)
        if tokens.reasoning:
            self.reasoning.append(tokens.reasoning)
        self.logprobs += tokens.logprobs
        self.tool_calls += tokens.tool_calls


def usage(group: SampleGroup) -> dict:
    """The prompt counts once, whatever ``n``; the completion tokens of every sample add up."""
    leader = group.leader
    prompt, completion = len(leader.prompt_token_ids), sum(len(job.generated) for job in group.started())
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": leader.cached_prompt_tokens}}


def new_request_id() -> str:
    return uuid.uuid4().hex
