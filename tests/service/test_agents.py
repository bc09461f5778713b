"""Agents on the demo model (SmolLM2-135M-Instruct, whose chat template has no tool format):
LangChain's `bind_tools` with its default tool_choice (auto) and its agent loop
(`langchain.agents.create_agent`, which replaced langgraph's `create_react_agent`), unchanged,
against the live service, run a tool and answer with its
result. The generic tool format (worker/engine/tools.py) makes that possible: tools in a
system turn, the answer decoded as a call or a response. Greedy, so the runs repeat."""
import pytest
from langchain_core.messages import ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

from conftest import own_service
from worker.engine.models import demo

NAME = "smol"
RESULT = "Sunny, 24 degrees Celsius"


@pytest.fixture(scope="module")
def demo_api(tmp_path_factory):
    with own_service(demo.fetch_demo_model(), tmp_path_factory.mktemp("agents"), NAME,
                     ["--kv-tokens", "16384"]) as (url, _):
        yield url


@tool
def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return RESULT


def llm(url: str) -> ChatOpenAI:
    return ChatOpenAI(base_url=url + "/v1", api_key="x", model=NAME, temperature=0, max_tokens=100, max_retries=0)


def test_bind_tools_with_its_default_choice_calls_the_tool_then_answers_with_its_result(demo_api):
    bound = llm(demo_api).bind_tools([get_weather])  # tool_choice: not sent (auto)
    messages = [("user", "What is the weather in Paris?")]
    first = bound.invoke(messages)
    assert [c["name"] for c in first.tool_calls] == ["get_weather"] and first.tool_calls[0]["args"] == {"city": "Paris"}
    # LangChain sends the call back with content "" and the result as a tool message.
    results = [ToolMessage(get_weather.invoke(c["args"]), tool_call_id=c["id"]) for c in first.tool_calls]
    final = bound.invoke(messages + [first] + results)
    assert not final.tool_calls and RESULT in final.content, final


def test_create_agent_runs_to_a_final_answer_that_used_the_tool(demo_api):
    from langchain.agents import create_agent

    agent = create_agent(llm(demo_api), [get_weather])
    out = agent.invoke({"messages": [("user", "What is the weather in Paris?")]}, {"recursion_limit": 6})
    kinds = [type(m).__name__ for m in out["messages"]]
    assert kinds == ["HumanMessage", "AIMessage", "ToolMessage", "AIMessage"], kinds
    assert out["messages"][2].content == RESULT and RESULT in out["messages"][-1].content


def test_required_stops_after_the_call_it_asked_for(demo_api):
    """Before the tools were described to a model without a tool format, `required` made
    it list the same call until max_tokens."""
    msg = llm(demo_api).bind_tools([get_weather], tool_choice="required").invoke("What is the weather in Paris?")
    assert [c["args"] for c in msg.tool_calls] == [{"city": "Paris"}]
    assert msg.response_metadata["finish_reason"] == "tool_calls"
