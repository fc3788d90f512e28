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


# A template that reads tools, documents and the tool turns of a conversation, as tool-use
# templates (Hermes, Llama 3.1, Qwen) do.
TOOL_USE = ("{% if tools %}[tools:{% for t in tools %}{{ t.function.name }} max {{ "
            "t.function.parameters.properties.n.maximum }}{% endfor %}]{% endif %}"
            "{% if documents %}[docs:{% for d in documents %}{{ d.title }};{% endfor %}]{% endif %}"
            "{% for m in messages %}<{{ m.role }}>{% if m.tool_calls %}{% for c in m.tool_calls %}call "
            "{{ c.id }} {{ c.function.name }} {{ c.function.arguments }}{% endfor %}{% elif m.role == 'tool' %}"
            "{{ m.tool_call_id }} {{ m.name }}={{ m.content }}{% else %}{{ m.content }}{% endif %}{% endfor %}")
TOOL = {"type": "function", "function": {"name": "roll", "description": "Roll a die",
                                         "parameters": {"type": "object", "properties": {
                                             "n": {"type": "integer", "minimum": 1, "maximum": 10}}}}}
DOCUMENT = {"title": "Dice", "text": "A die has six faces."}
TURNS = [{"role": "user", "content": "Roll one."},
         {"role": "assistant", "content": "", "tool_calls": [
             {"id": "call_1", "type": "function", "function": {"name": "roll", "arguments": "{\"n\": 1}"}}]},
         {"role": "tool", "tool_call_id": "call_1", "name": "roll", "content": "4"}]


def test_tools_documents_and_tool_turns_reach_the_template_unchanged():
    """What transformers' apply_chat_template(tools=, documents=) renders from the same Python
    objects (issue 34, point 6): the gRPC messages carry tool calls and tool answers, and a
    whole number in a tool's schema stays an int."""
    tokenizer = with_bos(TOOL_USE)
    request = pb.TokenizeRequest(add_generation_prompt=False)
    for turn in TURNS:
        message = request.messages.add(role=turn["role"], content=turn["content"],
                                       tool_call_id=turn.get("tool_call_id", ""), name=turn.get("name", ""))
        for call in turn.get("tool_calls", ()):
            message.tool_calls.add().update(call)
    request.tools.add().update(TOOL)
    request.documents.add().update(DOCUMENT)
    expected = tokenizer.apply_chat_template(TURNS, tools=[TOOL], documents=[DOCUMENT], tokenize=False)
    assert "[tools:roll max 10]" in expected and "call call_1 roll" in expected and "call_1 roll=4" in expected
    assert tokenize(tokenizer, request) == tokenizer.encode(expected, add_special_tokens=False)


def test_tools_and_documents_only_with_messages_and_within_the_limits(tokenizer):
    request = pb.TokenizeRequest(text="hi")
    request.tools.add().update(TOOL)
    with pytest.raises(InvalidArgument, match="tools: only with messages"):
        tokenize(tokenizer, request)
    limits = RequestLimits(max_prompt_bytes=300, max_messages=2).resolve(4096, tokenizer)
    ok = chat()
    ok.tools.add().update(TOOL)
    check_sizes(ok, limits, 4096)
    big = chat()
    big.documents.add().update({"text": "x" * 400})
    with pytest.raises(InvalidArgument, match="documents: .*--max-prompt-bytes"):
        check_sizes(big, limits, 4096)
    many = chat()
    for _ in range(3):
        many.tools.add().update({"type": "function"})
    with pytest.raises(InvalidArgument, match="tools has 3 entries; .*--max-messages"):
        check_sizes(many, limits, 4096)
