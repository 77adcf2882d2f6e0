"""glm-jax-serve driven by the client libraries people point at an OpenAI-compatible server (the `clients` extra):
langchain-openai, instructor, openai-agents, litellm, pydantic-ai.  Each test asserts the client's own parsed
result: a tool called with arguments that validate against the tool's schema, a pydantic object.  One server (the
shipped model) for the module; a library that is not installed skips its tests.

The shipped model is small and weak: it calls a tool or writes a schema's JSON only where the request constrains it
(tool_choice required / named, a json_schema response format); the server's grammar makes those always end within
max_tokens.  Its context is 256 tokens, so a tool takes one argument (measured: a two-argument tool's schema costs
~100 prompt tokens and its call ~95 more).  What a library can only do with an unconstrained tool choice, a
schema-less JSON mode or a longer context is an xfail until the default model is retrained."""

import importlib.util
from typing import Literal

import pytest
import serving
from pydantic import BaseModel, Field

import glm_jax

KEY = "test-key"
MODEL = "glm-jax-default"
ASK = "Weather in Verona?"
MAX = 120                # tokens: a constrained call or object ends well within them (the grammar fits the budget)
WEAK = "the shipped default model calls tools / writes a schema's JSON only when constrained (not yet retrained)"


def _needs(module: str):
    """Skip where the library is missing, before the module's server starts (importorskip in a test runs after)."""
    return pytest.mark.skipif(importlib.util.find_spec(module) is None,
                              reason=f"{module} is not installed (the clients extra)")


class City(BaseModel):                  # a tool's arguments
    city: Literal["Rome", "Verona"]


class Weather(BaseModel):               # a structured answer
    city: Literal["Rome", "Verona"]
    days: int = Field(ge=1, le=7)


@pytest.fixture(scope="module")
def server():
    from glm_jax.serve.app import Server

    eng = glm_jax.Engine.load(max_batch=4, prefill_chunk=16)
    srv = Server(eng, api_key=KEY, max_queue=16)
    try:
        with serving.running(srv):
            yield srv
    finally:
        eng.close()


@pytest.fixture(scope="module")
def base(server):
    return server.base + "/v1"


def _args_of(call) -> City:
    """A call's arguments (a dict or its JSON) validated against the tool's schema."""
    return City.model_validate_json(call) if isinstance(call, str) else City.model_validate(call)


# ----------------------------------------------------------------------------- langchain-openai
@pytest.fixture(scope="module")
def chat(base):
    lc = pytest.importorskip("langchain_openai")
    return lc.ChatOpenAI(model=MODEL, base_url=base, api_key=KEY, max_tokens=MAX, temperature=0, max_retries=0)


@_needs("langchain_openai")
@pytest.mark.parametrize("choice", ["any", "City"])
def test_langchain_bind_tools(chat, choice):
    msg = chat.bind_tools([City], tool_choice=choice).invoke(ASK)
    assert not msg.content and len(msg.tool_calls) >= 1, msg
    for call in msg.tool_calls:
        assert call["name"] == "City"
        _args_of(call["args"])


@_needs("langchain_openai")
@pytest.mark.parametrize("method", ["function_calling", "json_schema",
                                    pytest.param("json_mode", marks=pytest.mark.xfail(reason=WEAK))])
def test_langchain_structured_output(chat, method):
    cls = City if method == "function_calling" else Weather        # function_calling: a tool
    out = chat.with_structured_output(cls, method=method).invoke(ASK + " Answer in JSON with city and days.")
    assert isinstance(out, cls), out


# ----------------------------------------------------------------------------- instructor
@_needs("instructor")
@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor(base, mode):
    instructor = pytest.importorskip("instructor")
    import openai

    client = instructor.from_openai(openai.OpenAI(base_url=base, api_key=KEY, max_retries=0),
                                    mode=getattr(instructor.Mode, mode))
    cls = City if mode == "TOOLS" else Weather
    out = client.chat.completions.create(model=MODEL, response_model=cls, max_retries=0, max_tokens=MAX,
                                         temperature=0, messages=[{"role": "user", "content": ASK}])
    assert isinstance(out, cls), out


# ----------------------------------------------------------------------------- openai-agents
def _agents_model(base, kind):
    agents = pytest.importorskip("agents")
    import openai

    agents.set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=base, api_key=KEY, max_retries=0)
    cls = agents.OpenAIResponsesModel if kind == "responses" else agents.OpenAIChatCompletionsModel
    return agents, cls(model=MODEL, openai_client=client)


def _forecast_tool(agents, seen):
    @agents.function_tool
    def forecast(city: Literal["Rome", "Verona"]) -> str:
        seen.append(City(city=city))           # the arguments validated against the tool's schema
        return "sun"

    return forecast


@_needs("agents")
@pytest.mark.parametrize("kind", ["responses", "chat"])
def test_openai_agents_tool_and_structured_output(base, kind):
    """An agent with one function tool: tool_choice required calls it (the first turn also carries the output
    type's json_schema format), stop_on_first_tool ends the run with its result; an agent with a structured
    output_type answers with that type."""
    agents, model = _agents_model(base, kind)
    seen = []
    settings = agents.ModelSettings(tool_choice="required", max_tokens=MAX, temperature=0)
    agent = agents.Agent(name="w", model=model, tools=[_forecast_tool(agents, seen)], output_type=Weather,
                         model_settings=settings, tool_use_behavior="stop_on_first_tool")
    result = agents.Runner.run_sync(agent, ASK, max_turns=2)
    assert len(seen) == 1 and result.final_output == "sun", result
    agent = agents.Agent(name="w", model=model, output_type=Weather,
                         model_settings=agents.ModelSettings(max_tokens=MAX, temperature=0))
    assert isinstance(agents.Runner.run_sync(agent, ASK, max_turns=1).final_output, Weather)


@_needs("agents")
@pytest.mark.xfail(reason="the shipped default model's 256-token context cannot hold an agent's second turn (the "
                          "tool, its call and result: 271 prompt tokens, measured); not yet retrained")
def test_openai_agents_tool_result_then_structured_output(base):
    """The agent loop: the tool's result goes back and the next turn (tool_choice reset to auto) answers with the
    output type's JSON."""
    agents, model = _agents_model(base, "responses")
    seen = []
    agent = agents.Agent(name="w", model=model, tools=[_forecast_tool(agents, seen)], output_type=Weather,
                         model_settings=agents.ModelSettings(tool_choice="required", max_tokens=MAX, temperature=0))
    result = agents.Runner.run_sync(agent, ASK, max_turns=3)
    assert len(seen) == 1 and isinstance(result.final_output, Weather)


@_needs("agents")
@pytest.mark.xfail(reason=WEAK)
def test_openai_agents_default_settings_call_the_tool(base):
    """openai-agents' defaults (Responses API, tool_choice auto): the agent should call its tool on its own."""
    agents, model = _agents_model(base, "responses")
    seen = []
    agent = agents.Agent(name="w", model=model, tools=[_forecast_tool(agents, seen)], output_type=Weather,
                         model_settings=agents.ModelSettings(max_tokens=MAX))
    result = agents.Runner.run_sync(agent, ASK, max_turns=3)
    assert seen and isinstance(result.final_output, Weather)


# ----------------------------------------------------------------------------- litellm
@_needs("litellm")
def test_litellm_tool_call(base, monkeypatch):
    # litellm fetches a model price list from the network when imported (7 s of retries offline, measured)
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    litellm = pytest.importorskip("litellm")
    tool = {"type": "function", "function": {"name": "weather", "parameters": City.model_json_schema()}}
    r = litellm.completion(model="openai/" + MODEL, api_base=base, api_key=KEY, messages=[{"role": "user",
                           "content": ASK}], tools=[tool], tool_choice="required", max_tokens=MAX, temperature=0)
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and calls, r
    for c in calls:
        assert c.function.name == "weather"
        _args_of(c.function.arguments)


# ----------------------------------------------------------------------------- pydantic-ai
@_needs("pydantic_ai")
@pytest.mark.parametrize("how", ["tool", "native"])
def test_pydantic_ai_structured_output(base, how):
    pytest.importorskip("pydantic_ai")
    from pydantic_ai import Agent, NativeOutput
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=base, api_key=KEY))
    cls = City if how == "tool" else Weather
    agent = Agent(model, output_type=cls if how == "tool" else NativeOutput(cls), retries=0)
    out = agent.run_sync(ASK, model_settings={"max_tokens": MAX, "temperature": 0}).output
    assert isinstance(out, cls), out
