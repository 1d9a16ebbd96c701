"""Tool calling through `vllm serve MODEL --omni` with vLLM's tool parsers (same flags as `vllm serve`).

    vllm serve tiny/qwen2 --omni --gpu-memory-utilization 0.15 --max-model-len 512 \
        --enable-auto-tool-choice --tool-call-parser hermes &
    .venv/bin/python examples/online_serving/tool_calling.py --tool-choice required

The tiny checkpoint has random weights: `required` / a named function constrain it to a well-formed call (its
arguments follow the tool's JSON schema), `auto` lets it decide. With a real model (Qwen2.5, the Qwen3-Omni
thinker: `hermes`) the script then sends the tool's result back and prints the final answer.
"""

from __future__ import annotations

import argparse
import json

import server_args

TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "strict": True,
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                       "required": ["city"], "additionalProperties": False},
    },
}]


def main() -> None:
    parser = argparse.ArgumentParser()
    server_args.add_server_args(parser)
    parser.add_argument("--tool-choice", default="auto", help="auto | required | none | get_weather")
    parser.add_argument("--max-tokens", type=int, default=200)
    args = parser.parse_args()

    client = server_args.client(args)
    model = client.models.list().data[0].id
    choice = args.tool_choice
    if choice not in ("auto", "required", "none"):
        choice = {"type": "function", "function": {"name": choice}}
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    sample = {"max_tokens": args.max_tokens, "temperature": 1.0, "seed": 0}
    out = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice=choice, **sample)
    message = out.choices[0].message
    print("finish_reason:", out.choices[0].finish_reason)
    if not message.tool_calls:
        print("answer:", message.content)
        return
    for call in message.tool_calls:
        print(f"call {call.id}: {call.function.name}({call.function.arguments})")
    # Run the tools (here: a canned result) and send the results back for the final answer.
    messages.append(message.model_dump(exclude_none=True))
    for call in message.tool_calls:
        city = json.loads(call.function.arguments).get("city", "?")
        messages.append({"role": "tool", "tool_call_id": call.id, "content": f"sunny, 21 C in {city}"})
    final = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice="none", **sample)
    print("answer:", final.choices[0].message.content)


if __name__ == "__main__":
    main()
