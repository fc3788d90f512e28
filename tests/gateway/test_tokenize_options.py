"""Tokenize's choices (the gRPC call, and vLLM's ``/tokenize`` behind it): left unset, a text is
encoded as Generate encodes it (with the tokenizer's special tokens) and a chat as Generate
renders it (the template writes its own markers, nothing added); ``add_special_tokens`` and
``add_generation_prompt`` change that when asked. The tokenizer is the default model's, with a
BOS added to every encoding (as Llama's tokenizer does) so the choice shows in the ids."""
import asyncio
import types

import pytest
from tokenizers.processors import TemplateProcessing
from transformers import PreTrainedTokenizerFast

from splitserve.common.errors import InvalidArgument
from splitserve.common.limits import RequestLimits
from splitserve.engine.model_loader import DEFAULT_MODEL, load_tokenizer, resolve_model
from splitserve.gateway.servicer import GenerationServicer
from splitserve.v1 import generation_pb2 as pb
from splitserve.wire import check_sizes

CHAT = [pb.ChatMessage(role="user", content="hi")]


# A template reading two variables beyond the conversation, as Qwen3's reads enable_thinking.
THINKING = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
            "{% if enable_thinking is defined and not enable_thinking %}<no_think>{% endif %}"
            "{% for i in range(repeat | default(0)) %}!{% endfor %}")


def with_bos(template: str | None = None) -> PreTrainedTokenizerFast:
    base = load_tokenizer(resolve_model(DEFAULT_MODEL))
    backend = base.backend_tokenizer
    bos = base.convert_tokens_to_ids("<|endoftext|>")
    backend.post_processor = TemplateProcessing(single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", bos)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|endoftext|>")
    tokenizer.chat_template = template or base.chat_template
    return tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return with_bos()


def tokenize(tokenizer, request: pb.TokenizeRequest) -> list[int]:
    info = pb.ModelInfo(max_model_len=4096, vocab_size=len(tokenizer))
    gateway = GenerationServicer(state=None, dispatcher=types.SimpleNamespace(ledger=None), tokenizer=tokenizer,
                                 model_info=info, limits=RequestLimits().resolve(4096, tokenizer),
                                 grammars=object())
    return list(asyncio.run(gateway.Tokenize(request, None)).token_ids)


def test_text_gets_special_tokens_unless_told_not_to(tokenizer):
    plain = tokenizer.encode("The capital of France", add_special_tokens=False)
    bos = tokenizer.bos_token_id
    assert tokenize(tokenizer, pb.TokenizeRequest(text="The capital of France")) == [bos, *plain]
    assert tokenize(tokenizer, pb.TokenizeRequest(text="The capital of France", add_special_tokens=True)) == [
        bos, *plain]
    assert tokenize(tokenizer, pb.TokenizeRequest(text="The capital of France", add_special_tokens=False)) == plain


def test_a_chat_gets_none_unless_asked_and_its_generation_prompt_when_asked(tokenizer):
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                             add_generation_prompt=True)
    without_prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                                   add_generation_prompt=False)
    assert rendered != without_prompt
    ids = tokenizer.encode(rendered, add_special_tokens=False)
    assert tokenize(tokenizer, pb.TokenizeRequest(messages=CHAT, add_generation_prompt=True)) == ids
    assert tokenize(tokenizer, pb.TokenizeRequest(messages=CHAT, add_generation_prompt=True,
                                                  add_special_tokens=True)) == [tokenizer.bos_token_id, *ids]
    assert tokenize(tokenizer, pb.TokenizeRequest(messages=CHAT)) == tokenizer.encode(without_prompt,
                                                                                     add_special_tokens=False)


def chat(**variables) -> pb.TokenizeRequest:
    request = pb.TokenizeRequest(messages=CHAT)
    request.chat_template_kwargs.update(variables)
    return request


def test_template_variables_reach_a_template_that_reads_them():
    tokenizer = with_bos(THINKING)
    ids = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    assert tokenize(tokenizer, chat()) == ids("<user>hi")
    assert tokenize(tokenizer, chat(enable_thinking=False)) == ids("<user>hi<no_think>")
    # A whole JSON number stays an int (range() takes no float).
    assert tokenize(tokenizer, chat(repeat=3)) == ids("<user>hi!!!")
    # Names the template does not read are left out (a client may send them to every model).
    assert tokenize(tokenizer, chat(reasoning_effort="high")) == ids("<user>hi")


def test_a_template_with_transformers_own_tags_still_gets_its_variables():
    """transformers renders ``{% generation %}`` (assistant-token masks) and ``{% break %}``; a
    template using them cannot be parsed without its extensions, and must still render (with the
    request's variables) rather than fail the request."""
    tagged = ("{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{{ m.content }}"
              "{% endgeneration %}{% else %}<{{ m.role }}>{{ m.content }}{% endif %}{% if loop.index > 5 %}"
              "{% break %}{% endif %}{% endfor %}{% if enable_thinking is defined and not enable_thinking %}"
              "<no_think>{% endif %}")
    tokenizer = with_bos(tagged)
    assert tokenize(tokenizer, chat(enable_thinking=False)) == tokenizer.encode("<user>hi<no_think>",
                                                                                add_special_tokens=False)


@pytest.mark.parametrize("name", ["messages", "tools", "add_generation_prompt", "chat_template", "bos_token"])
def test_names_the_server_sets_are_refused(name):
    tokenizer = with_bos(THINKING)
    with pytest.raises(InvalidArgument, match=f"chat_template_kwargs.{name}: set by the server"):
        tokenize(tokenizer, chat(**{name: "x"}))


def test_template_variables_only_with_messages_and_within_the_prompt_limit(tokenizer):
    request = pb.TokenizeRequest(text="hi")
    request.chat_template_kwargs.update({"enable_thinking": False})
    with pytest.raises(InvalidArgument, match="chat_template_kwargs: only with messages"):
        tokenize(tokenizer, request)
    limits = RequestLimits(max_prompt_bytes=100).resolve(4096, tokenizer)
    check_sizes(chat(note="x" * 50), limits, 4096)
    with pytest.raises(InvalidArgument, match="chat_template_kwargs: .*--max-prompt-bytes"):
        check_sizes(chat(note="x" * 200), limits, 4096)
