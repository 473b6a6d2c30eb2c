"""Load a Colibri server with streamed chat completions, as many chat users at once would.

    pip install locust
    locust -f examples/locustfile.py --host http://127.0.0.1:8000 --users 64 --spawn-rate 16 --run-time 60s --headless

Every simulated user sends streamed chat requests back to back (with a short think time). Next to the request
itself ("chat stream", timed until the response headers: admission) locust reports "time to first token",
"inter-token latency" (the mean gap between content chunks of one stream) and "whole stream". Environment:
COLIBRI_API_KEY when the server requires a key, COLIBRI_MAX_TOKENS for the answer length (default 64).
"""

from __future__ import annotations

import json
import os
import random
import time

from locust import HttpUser, between, task

PROMPTS = (
    "Explain mixture-of-experts models in two sentences.",
    "Write a haiku about hummingbirds.",
    "List three uses of a paged KV cache.",
    "Translate 'good morning' into French, German and Japanese.",
    "What is the capital of Australia? Answer in one word.",
)
MAX_TOKENS = int(os.environ.get("COLIBRI_MAX_TOKENS", "64"))


class ChatUser(HttpUser):
    """One chat user: a streamed chat completion, a pause, another one."""

    wait_time = between(0.1, 0.5)

    def on_start(self) -> None:
        key = os.environ.get("COLIBRI_API_KEY")
        if key:
            self.client.headers["Authorization"] = f"Bearer {key}"

    @task
    def stream_chat(self) -> None:
        body = {"messages": [{"role": "user", "content": random.choice(PROMPTS)}], "max_tokens": MAX_TOKENS,
                "temperature": 0.7, "stream": True}
        start = time.perf_counter()
        arrivals = []
        with self.client.post("/v1/chat/completions", json=body, stream=True, catch_response=True,
                              name="chat stream") as response:
            if response.status_code != 200:
                response.failure(f"HTTP {response.status_code}: {response.text[:200]}")
                return
            for line in response.iter_lines():
                if not line.startswith(b"data: "):
                    continue  # blank separators and keep-alive comments
                data = line[len(b"data: "):]
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    response.failure(chunk["error"]["message"])
                    return
                if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    arrivals.append(time.perf_counter())
            else:
                response.failure("the stream ended without data: [DONE]")
                return
            response.success()
        self._report("whole stream", time.perf_counter() - start)
        if arrivals:
            self._report("time to first token", arrivals[0] - start)
        if len(arrivals) > 1:
            self._report("inter-token latency", (arrivals[-1] - arrivals[0]) / (len(arrivals) - 1))

    def _report(self, name: str, seconds: float) -> None:
        self.environment.events.request.fire(request_type="SSE", name=name, response_time=seconds * 1000,
                                             response_length=0, exception=None, context={})
