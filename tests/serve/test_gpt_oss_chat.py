"""gpt-oss's chat on the server started as vLLM serves it (--reasoning-parser openai_gptoss,
--enable-auto-tool-choice --tool-call-parser openai),
through the official openai client, on a tiny random gpt-oss over a byte-level tokenizer with
harmony's special tokens (tests/helpers/gpt_oss.chat_model): a structured-outputs grammar
makes the random model write an analysis message and a final one, special tokens and all;
the reply comes back with the analysis as ``reasoning`` and the final message as
``content``, whole and streamed. The parser on hand-written replies:
tests/serve/test_tool_parsers.py::test_harmony_channels."""

from __future__ import annotations

import openai
import pytest

from tests.helpers import gpt_oss

# harmony's tags as special tokens (llguidance's <|name|> in a lark grammar), the bodies as text
REPLY = ('start: <|channel|> "analysis" <|message|> "The user greets." <|end|> <|start|> "assistant" '
         '<|channel|> "final" <|message|> "Hello!" <|return|>')


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    from starlette.testclient import TestClient

    import jspec
    from jspec.serve.app import create_app

    folder = gpt_oss.chat_model(str(tmp_path_factory.mktemp("gpt_oss_chat")))
    llm = jspec.LLM(folder, max_num_seqs=2, max_model_len=96, page_size=16,
                    speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3})
    app = create_app(llm.engine, "gpt-oss-tiny", reasoning_parser="openai_gptoss", enable_auto_tool_choice=True,
                     tool_call_parser="openai")
    with TestClient(app) as http:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http)


def ask(client, **kw):
    return client.chat.completions.create(model="gpt-oss-tiny", messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=60, temperature=0, **kw)


def test_reasoning_and_content_separated(client):
    c = ask(client, extra_body={"structured_outputs": {"grammar": REPLY}}).choices[0]
    assert (c.message.reasoning, c.message.content, c.finish_reason) == ("The user greets.", "Hello!", "stop")
    reasoning, content, finish = "", "", None
    for chunk in ask(client, stream=True, extra_body={"structured_outputs": {"grammar": REPLY}}):
        d = chunk.choices[0].delta
        reasoning += getattr(d, "reasoning", None) or ""
        content += d.content or ""
        finish = chunk.choices[0].finish_reason or finish
    assert (reasoning, content, finish) == ("The user greets.", "Hello!", "stop")


def test_the_channels_need_the_special_tokens(client):
    """The server decodes this parser's replies with their special tokens; a request that asks
    for them skipped gets the text without harmony's tags, all content."""
    c = ask(client, extra_body={"structured_outputs": {"grammar": REPLY}, "skip_special_tokens": True}).choices[0]
    assert (c.message.reasoning, c.message.content) == (None, "analysisThe user greets.assistantfinalHello!")


# (59 tokens: the byte tokenizer spends a token a character, and the reply has 60)
CALL = ('start: <|channel|> "analysis" <|message|> "H" <|end|> <|start|> "assistant to=functions.w" '
        '<|channel|> "commentary" <|message|> "{\\"c\\":\\"P\\"}" <|call|>')
TOOLS = [{"type": "function", "function": {"name": "w", "parameters": {
    "type": "object", "properties": {"c": {"type": "string"}}, "required": ["c"]}}}]


def test_tool_call_comes_back_as_tool_calls(client):
    """A harmony message to functions.w (the grammar writes it) is a tool call of the reply,
    whole and streamed; the analysis before it the reasoning."""
    body = {"structured_outputs": {"grammar": CALL}}
    c = ask(client, tools=TOOLS, tool_choice="auto", extra_body=body).choices[0]
    assert c.finish_reason == "tool_calls" and c.message.reasoning == "H" and not c.message.content
    assert [(t.function.name, t.function.arguments) for t in c.message.tool_calls] == [("w", '{"c": "P"}')]  # as json.dumps writes it
    name, args, finish = None, "", None
    for chunk in ask(client, tools=TOOLS, tool_choice="auto", stream=True, extra_body=body):
        for t in chunk.choices[0].delta.tool_calls or []:
            name = t.function.name or name
            args += t.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert (name, args, finish) == ("w", '{"c":"P"}', "tool_calls")  # streamed as written
