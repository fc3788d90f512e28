"""OpenAI response bodies: completions and chat completions, whole or as stream chunks."""
from __future__ import annotations

import time
import uuid

from gateway.job import Finished, Job

# Our finish reasons -> OpenAI's (a request that failed carries an error body instead).
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}


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
        self.text_offset = 0  # completions' logprobs.text_offset counts the text sent so far

    # ---- whole answers ------------------------------------------------------------------
    def whole(self, job: Job, text: str, logprobs: list, finished: Finished) -> dict:
        body = self._whole(job, text, logprobs, finished)
        if self.token_ids:
            body["choices"][0]["token_ids"] = list(job.generated)
            body["prompt_token_ids"] = list(job.prompt_token_ids)
        return body

    def _whole(self, job: Job, text: str, logprobs: list, finished: Finished) -> dict:
        reason = FINISH_REASONS.get(finished.finish_reason, finished.finish_reason)
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": self.chat_logprobs(logprobs) if logprobs else None,
                      "finish_reason": reason, "stop_reason": job.text.matched if job.text else None}
        else:
            choice = {"index": 0, "text": text, "logprobs": self.completion_logprobs(logprobs) if logprobs else None,
                      "finish_reason": reason, "stop_reason": job.text.matched if job.text else None}
        return {**self._head(whole=True), "choices": [choice], "usage": usage(job)}

    # ---- stream chunks ------------------------------------------------------------------
    def chunk(self, text: str, logprobs: list, finish_reason: str | None = None, role: bool = False,
              with_usage: bool = False, token_ids: list[int] = ()) -> dict:
        reason = FINISH_REASONS.get(finish_reason, finish_reason) if finish_reason else None
        if self.chat:
            delta = {"role": "assistant", "content": text} if role else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "logprobs": self.chat_logprobs(logprobs) if logprobs else None,
                      "finish_reason": reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": self.completion_logprobs(logprobs) if logprobs else None,
                      "finish_reason": reason}
        if self.token_ids:
            choice["token_ids"] = list(token_ids)
        body = {**self._head(whole=False), "choices": [choice]}
        if with_usage:
            body["usage"] = None  # stream_options.include_usage: null on every chunk but the last
        return body

    def usage_chunk(self, job: Job) -> dict:
        return {**self._head(whole=False), "choices": [], "usage": usage(job)}

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

    def completion_logprobs(self, entries: list) -> dict:
        """The legacy shape: parallel lists of tokens, their logprobs, top alternatives, text offsets."""
        tokens, logprobs, tops, offsets = [], [], [], []
        for e in entries:
            token = self._token(e.token_id)
            tokens.append(token)
            logprobs.append(e.logprob)
            tops.append({self._token(t.token_id): t.logprob for t in e.top} | {token: e.logprob})
            offsets.append(self.text_offset)
            self.text_offset += len(token)
        return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}


def usage(job: Job) -> dict:
    prompt, completion = len(job.prompt_token_ids), len(job.generated)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": job.cached_prompt_tokens}}


def new_request_id() -> str:
    return uuid.uuid4().hex
