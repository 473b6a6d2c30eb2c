import json
import openai
from test_server import API_KEY


def test_probe(tiny_server):
    c = openai.OpenAI(base_url=tiny_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    cases = {
        "ids": dict(prompt=[1, 2, 3]),
        "ids_batch": dict(prompt=[[1, 2], [3, 4]]),
        "str_batch": dict(prompt=["a", "b"], n=2),
        "empty_str": dict(prompt=""),
        "empty_list": dict(prompt=[]),
        "echo_lp": dict(prompt="hello there", echo=True, logprobs=2, max_tokens=2),
        "lp5": dict(prompt="x", logprobs=5),
        "best_of": dict(prompt="x", best_of=1),
        "stream_usage": dict(prompt="x", stream=True, stream_options={"include_usage": True}, n=2),
        "stop_empty": dict(prompt="x", stop=[]),
        "stop_none": dict(prompt="x", stop=None),
        "max_none": dict(prompt="x", max_tokens=None),
        "temperature0": dict(prompt="x", temperature=0),
        "logit_bias_neg": dict(prompt="x", logit_bias={"3": -100}),
        "seed_neg": dict(prompt="x", seed=-1),
        "user": dict(prompt="x", user="me"),
        "suffix_empty": dict(prompt="x", suffix=""),
    }
    for name, kw in cases.items():
        kw = dict(kw)
        kw.setdefault("max_tokens", 3)
        try:
            r = c.completions.create(model="tiny", **kw)
            if kw.get("stream"):
                chunks = list(r)
                print(name, "OK stream", len(chunks), chunks[-1].usage)
            else:
                print(name, "OK", [repr(ch.text)[:20] for ch in r.choices], r.choices[0].finish_reason, r.usage.prompt_tokens)
        except Exception as e:
            print(name, "ERR", type(e).__name__, str(e)[:200])
    rcases = {
        "dev": dict(input=[{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}]),
        "instr": dict(input="hi", instructions="be brief"),
        "parts": dict(input=[{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}]),
        "msgtype": dict(input=[{"type": "message", "role": "user", "content": "hi"}]),
        "text_verbosity": dict(input="hi", extra_body={"text": {"verbosity": "low"}}),
        "max16": dict(input="hi", max_output_tokens=16),
        "tools_empty": dict(input="hi", tools=[]),
        "store": dict(input="hi", store=False),
        "reasoning_none": dict(input="hi", reasoning={"effort": None}),
        "truncation": dict(input="hi", truncation="disabled"),
        "include": dict(input="hi", include=[]),
        "parallel": dict(input="hi", parallel_tool_calls=True),
        "service_tier": dict(input="hi", service_tier="auto"),
    }
    for name, kw in rcases.items():
        kw.setdefault("max_output_tokens", 3)
        try:
            r = c.responses.create(model="tiny", **kw)
            print("R", name, "OK", r.status, repr(r.output_text)[:20])
        except Exception as e:
            print("R", name, "ERR", type(e).__name__, str(e)[:200])
