"""The Serve application end to end: a real Serve instance on the session's local Ray cluster, real
HTTP on a free loopback port, one deployment shared by every test.

The target is a tiny random Llama with SmolLM2's tokenizer and chat template, run in float64 (no
argmax near-ties between a block forward and a one-token forward), with a random drafter checkpoint.
"""

import json
import os
import re
import shutil
import signal
import socket
import threading
import time
import uuid
from pathlib import Path

import pytest
import requests
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from domino.target import Target, resolve_target
from helpers import tiny_drafter

# Ray warns when look_back_period_s is below the deprecated metrics_interval_s (10 s); the interval
# that matters, the metrics push interval, is 0.5 s in the session's cluster (tests/conftest.py).
pytestmark = pytest.mark.filterwarnings("ignore:`look_back_period_s`:FutureWarning")

APP = "domino-test"
CONTEXT = 2048
# Small delays so that one test sees 1 -> 2 -> 1 replicas within a minute. With 3 ongoing requests per
# replica as the target, the other tests (at most 2 requests at once) never scale up.
AUTOSCALING = dict(min_replicas=1, max_replicas=2, target_ongoing_requests=3, upscale_delay_s=1.0,
                   downscale_delay_s=3.0, look_back_period_s=2.0)


@pytest.fixture(scope="module")
def models(tmp_path_factory, embedded_target) -> Path:
    """A tiny target folder (SmolLM2's tokenizer, vocabulary 49152, hidden 64) and a random drafter."""
    root = tmp_path_factory.mktemp("serve-models")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT,
                         tie_word_embeddings=True, initializer_range=0.1, bos_token_id=1, eos_token_id=2,
                         pad_token_id=2)
    LlamaForCausalLM(config).save_pretrained(root / "target")
    tokenizer_dir = Path(resolve_target("smollm2-135m"))  # converted by the embedded_target fixture
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tokenizer_dir / name, root / "target" / name)
    target = Target.load(str(root / "target"), dtype=torch.float64)
    tiny_drafter(target, block_size=4).save_pretrained(root / "drafter")
    return root


@pytest.fixture(scope="module")
def reference(models) -> Target:
    """The same target in this process, for transformers' own greedy output."""
    return Target.load(str(models / "target"), dtype=torch.float64)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(ray_cluster, models) -> str:
    from ray import serve

    from pipelines.serve import ServeArgs, application

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    args = ServeArgs(target=str(models / "target"), drafter=str(models / "drafter"), dtype="float64",
                     model_name="tiny")
    # health checks every second: a killed replica is replaced within seconds (the recovery test)
    serve.run(application(args, autoscaling_config=AUTOSCALING, health_check_period_s=1.0), name=APP,
              route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()


# -- helpers ---------------------------------------------------------------------------------------


def post(server: str, path: str, **body) -> requests.Response:
    return requests.post(f"{server}{path}", json=body, timeout=120)


def events(server: str, path: str, **body):
    """The JSON objects of a streamed response, checking that it ends with [DONE]."""
    with requests.post(f"{server}{path}", json={**body, "stream": True}, stream=True, timeout=120) as response:
        assert response.status_code == 200, response.text
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == b"data: [DONE]"
    return [json.loads(line.removeprefix(b"data: ")) for line in lines[:-1]]


def streamed_text(chunks: list[dict]) -> str:
    choices = [chunk["choices"][0] for chunk in chunks]
    return "".join(c["text"] if "text" in c else c["delta"].get("content", "") for c in choices)


def hf_greedy(target: Target, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt_ids])
    out = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                do_sample=False, eos_token_id=target.stop_token_ids, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def wait_for(condition, timeout: float, every: float = 0.25) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(every)
    return False


# -- correctness -----------------------------------------------------------------------------------


@pytest.mark.parametrize("prompt, max_tokens", [("The quick brown fox", 24), ("Once upon a time", 37)])
def test_greedy_completion_is_the_targets_own_output(server, reference, prompt, max_tokens):
    body = post(server, "/v1/completions", model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0).json()
    expected = hf_greedy(reference, reference.encode_prompt(prompt, chat=False), max_tokens)
    assert body["choices"][0]["text"] == reference.tokenizer.decode(expected, skip_special_tokens=True)
    assert body["usage"]["completion_tokens"] == len(expected)
    assert body["metrics"]["rounds"] >= 1 and body["metrics"]["tau"] >= 1.0
    spec = body["metrics"]["speculative_decoding"]
    assert spec["mean_acceptance_length"] == pytest.approx(1 + spec["num_accepted_draft_tokens"] / spec["num_drafts"])


def test_greedy_chat_is_the_targets_own_output_on_the_chat_template(server, reference):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    body = post(server, "/v1/chat/completions", messages=messages, max_tokens=30, temperature=0).json()
    prompt_ids = reference.encode_prompt(messages)
    expected = hf_greedy(reference, prompt_ids, 30)
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant",
                                             "content": reference.tokenizer.decode(expected, skip_special_tokens=True)}
    assert body["usage"] == {"prompt_tokens": len(prompt_ids), "completion_tokens": len(expected),
                             "total_tokens": len(prompt_ids) + len(expected)}


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", dict(prompt="Hello world", max_tokens=24, temperature=0)),
    ("/v1/completions", dict(prompt=[1, 2, 3, 4], max_tokens=24, temperature=0.9, top_p=0.9, top_k=50, seed=7)),
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "Hi"}], max_tokens=24, temperature=0)),
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
                                  max_tokens=24, temperature=1.2, seed=3)),
])
def test_streamed_chunks_concatenate_to_the_full_text(server, path, body):
    full = post(server, path, **body).json()
    chunks = events(server, path, **body, stream_options={"include_usage": True})
    text = full["choices"][0]["text" if "text" in full["choices"][0] else "message"]
    text = text["content"] if isinstance(text, dict) else text
    assert streamed_text(chunks[:-1]) == text
    finish, last = chunks[-2], chunks[-1]
    assert finish["choices"][0]["finish_reason"] == full["choices"][0]["finish_reason"]
    assert finish["metrics"]["tau"] == full["metrics"]["tau"]
    assert last["choices"] == [] and last["usage"] == full["usage"]
    assert all("usage" not in chunk for chunk in chunks[:-1])
    assert "usage" not in events(server, path, **body)[-1]  # usage only when asked for


def test_streamed_completion_logprobs_equal_the_whole_ones(server):
    """Text held back for a stop string does not shift the streamed tokens' text_offset."""
    body = dict(prompt="Hello, my name is", max_tokens=20, temperature=0, logprobs=1, stop="zzzzzzzz")
    whole = post(server, COMPLETIONS, **body).json()["choices"][0]
    parts = [c["choices"][0]["logprobs"] for c in events(server, COMPLETIONS, **body)
             if c["choices"] and c["choices"][0]["logprobs"]]
    for key in ("tokens", "token_logprobs", "text_offset"):
        assert sum((part[key] for part in parts), []) == whole["logprobs"][key]
    offsets, tokens = whole["logprobs"]["text_offset"], whole["logprobs"]["tokens"]
    assert all(whole["text"][offset:].startswith(token) for offset, token in zip(offsets, tokens))


def test_stop_strings_end_the_text_before_them(server):
    full = post(server, "/v1/completions", prompt="Hello world", max_tokens=40, temperature=0).json()
    text = full["choices"][0]["text"]
    stop = text[len(text) // 2: len(text) // 2 + 3]
    cut = post(server, "/v1/completions", prompt="Hello world", max_tokens=40, temperature=0, stop=[stop]).json()
    assert cut["choices"][0] == {"index": 0, "text": text[: text.index(stop)], "logprobs": None,
                                 "finish_reason": "stop"}
    chunks = events(server, "/v1/completions", prompt="Hello world", max_tokens=40, temperature=0, stop=stop)
    assert streamed_text(chunks) == text[: text.index(stop)]


def test_models_and_health(server):
    models = requests.get(f"{server}/v1/models", timeout=30).json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["tiny"]
    health = requests.get(f"{server}/health", timeout=30).json()
    assert health["status"] == "ok" and health["model"] == "tiny"


# -- bad input -------------------------------------------------------------------------------------

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HELLO = [{"role": "user", "content": "Hello"}]


@pytest.mark.parametrize("path, body, status, param, message", [
    (COMPLETIONS, b'{"prompt": "Hello", "max_tokens": 5', 400, None, "not valid JSON"),
    (COMPLETIONS, b'["prompt"]', 400, None, "valid dictionary"),
    (CHAT, dict(model="gpt-9", messages=HELLO), 404, "model", "'gpt-9' is not served here"),
    (CHAT, dict(messages=[]), 400, "messages", "at least 1 item"),
    (CHAT, dict(messages=[{"role": "wizard", "content": "Hi"}]), 400, "messages.0.role", "Input should be"),
    (COMPLETIONS, dict(prompt="Hello", max_tokens=0), 400, "max_tokens", "greater than 0"),
    (CHAT, dict(messages=HELLO, max_tokens=-3), 400, "max_tokens", "greater than 0"),
    # types are strict, as JSON Schema's: no string or fraction for a count, no string for a flag
    (COMPLETIONS, dict(prompt="Hello", max_tokens="5"), 400, "max_tokens", "valid integer"),
    (COMPLETIONS, dict(prompt="Hello", n=1.5), 400, "n", "valid integer"),
    (COMPLETIONS, dict(prompt=[9906, 1.5]), 400, "prompt.1", "valid integer"),
    (CHAT, dict(messages=HELLO, stream="true"), 400, "stream", "valid boolean"),
    (CHAT, dict(messages=HELLO, stream=True, stream_options={"include_usage": "yes"}), 400,
     "stream_options.include_usage", "valid boolean"),
    (COMPLETIONS, dict(prompt="Hello", max_tokens=CONTEXT), 400, "max_tokens", "max_tokens asks for 2048: lower it"),
    (CHAT, dict(messages=HELLO, max_completion_tokens=CONTEXT), 400, "max_completion_tokens", "in this model's context"),
    (COMPLETIONS, dict(prompt="Hello", temperature=2.5), 400, "temperature", "less than or equal to 2"),
    (COMPLETIONS, dict(prompt="Hello", temperature=-1), 400, "temperature", "greater than or equal to 0"),
    (COMPLETIONS, dict(prompt="Hello", top_p=0), 400, "top_p", "greater than 0"),
    (COMPLETIONS, b'{"prompt": "Hello", "temperature": NaN}', 400, "temperature", "finite number"),
    (CHAT, b'{"messages": [{"role": "user", "content": "Hi"}], "top_p": Infinity}', 400, "top_p", "finite number"),
    (COMPLETIONS, dict(prompt="Hello", n=17), 400, "n", "less than or equal to 16"),
    (CHAT, dict(messages=HELLO, tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tools",
     "tools: not supported by this server"),
    (CHAT, dict(messages=HELLO, frequency_penalty=0.5), 400, "frequency_penalty", "Input should be 0"),
    (COMPLETIONS, dict(prompt="Hello", echo=True), 400, "echo", "not supported"),
    (CHAT, dict(messages=[{"role": "user", "content": "Hi", "name": "bob"}]), 400, "messages.0.name",
     "not supported"),
    (CHAT, dict(messages=HELLO, top_logprobs=2), 400, None, "top_logprobs needs logprobs: true"),
    (COMPLETIONS, dict(prompt="Hello", stream_options={"include_usage": True}), 400, None,
     "stream_options needs stream: true"),
    (COMPLETIONS, dict(prompt="Hello", stream_options={"include_usage": True}), 400, None, "^stream_options"),
    (CHAT, b'{"messages": [{"role": "user", "content": "abc \\ud83d"}]}', 400, "messages.0.content",
     "lone UTF-16 surrogate"),
    (CHAT, dict(messages=HELLO, logprobs=True, top_logprobs=21), 400, "top_logprobs", "less than or equal to 20"),
    (COMPLETIONS, dict(prompt="Hello", logprobs=6), 400, "logprobs", "less than or equal to 5"),
    (COMPLETIONS, dict(prompt="Hello", seed=1 << 64), 400, "seed", "less than or equal to"),
    (COMPLETIONS, dict(prompt=[3, -1]), 400, "prompt.1", "greater than or equal to 0"),
    (COMPLETIONS, dict(prompt=["Hello", "Hi"]), 400, "prompt", "several prompts in one request are not supported"),
    (COMPLETIONS, b"", 400, None, "the request has no body"),
    (COMPLETIONS, dict(prompt="word " * CONTEXT), 400, "prompt", "but this model's context holds 2048"),
    (CHAT, dict(messages=[{"role": "user", "content": "word " * CONTEXT}]), 400, "messages", "context holds 2048"),
    (COMPLETIONS, dict(prompt=""), 400, "prompt", "at least 1 character"),
    (COMPLETIONS, dict(prompt=[5, 49152]), 400, "prompt", "token ids must lie in 0..49151"),
    (COMPLETIONS, dict(max_tokens=5), 400, "prompt", "Field required"),
    (COMPLETIONS, dict(prompt="x" * (32 * CONTEXT + 1)), 400, "prompt", "more than the target's context of 2048"),
    (CHAT, dict(messages=[{"role": "user", "content": "x" * (32 * CONTEXT + 1)}]), 400, "messages", "characters"),
    # refused before the chat template renders them, or the replica's other streams stall
    (CHAT, dict(messages=[{"role": "user", "content": ""}] * (CONTEXT + 1)), 400, "messages", "2049 messages"),
    # no recursion over a deeply nested value, whatever field holds it
    (COMPLETIONS, b'{"prompt": "Hi", "foo": ' + b"[" * 600 + b"]" * 600 + b"}", 400, "foo", "not supported"),
    # streams are refused before their status line, with the same error body
    (COMPLETIONS, dict(prompt="word " * CONTEXT, stream=True), 400, "prompt", "but this model's context holds 2048"),
    (CHAT, dict(messages=HELLO, max_tokens=CONTEXT, stream=True), 400, "max_tokens", "lower it to"),
    (COMPLETIONS, dict(prompt=[5, 49152], stream=True), 400, "prompt", "token ids must lie in 0..49151"),
])
def test_bad_input_gets_an_openai_error_and_the_replica_stays_healthy(server, path, body, status, param, message):
    if isinstance(body, bytes):
        response = requests.post(f"{server}{path}", data=body, headers={"content-type": "application/json"},
                                 timeout=30)
    else:
        response = post(server, path, **body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (re.match(message, error["message"]) if message.startswith("^") else message in error["message"])
    assert error["param"] == param
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    good = post(server, path if path == COMPLETIONS else CHAT, max_tokens=2, temperature=0,
                **({"prompt": "Hello"} if path == COMPLETIONS else {"messages": HELLO}))
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] >= 1


def engine_replica_log_lines() -> list[str]:
    """Every line the engine replicas wrote to their Serve log files so far (Ray's session folder)."""
    import ray

    logs = Path(ray._private.worker._global_node.get_session_dir_path()) / "logs" / "serve"
    return [line for file in sorted(logs.glob(f"replica_{APP}_EngineReplica_*.log"))
            for line in file.read_text(errors="replace").splitlines()]


def test_a_refused_request_is_logged_in_one_line_without_a_traceback(server):
    """Serve logs a replica method that raises as a failed call (ERROR, with its traceback). A refused
    request is the client's mistake: the engine replica logs one INFO line for it, streamed or not, and
    no line of that request reads ERROR."""
    model = f"no-such-model-{uuid.uuid4().hex[:8]}"
    request_ids = []
    for stream in (False, True):
        response = post(server, CHAT, model=model, messages=HELLO, max_tokens=2, stream=stream)
        assert response.status_code == 404, response.text
        request_ids.append(response.headers["x-request-id"])
    lines = engine_replica_log_lines()
    mentions = [line for line in lines if model in line]
    assert len(mentions) == 2, mentions
    assert all(line.startswith("INFO ") and "request refused: the model" in line for line in mentions), mentions
    of_these_requests = [line for line in lines if any(i in line for i in request_ids)]
    assert len(of_these_requests) >= 4, of_these_requests  # the refusal and Serve's access line, each
    assert not [line for line in of_these_requests if " ERROR" in line], of_these_requests


def test_null_options_mean_their_defaults(server):
    """Clients may send null for an option left unset (OpenAI's spec allows it for these)."""
    nulls = dict(temperature=None, top_p=None, top_k=None, n=None, stream=None, logprobs=None, stop=None)
    with_nulls = post(server, COMPLETIONS, prompt="Hello", max_tokens=6, seed=5, **nulls)
    without = post(server, COMPLETIONS, prompt="Hello", max_tokens=6, seed=5)
    assert with_nulls.status_code == 200, with_nulls.text
    assert with_nulls.json()["choices"] == without.json()["choices"]
    chat = post(server, CHAT, messages=HELLO, max_tokens=2, logprobs=None, top_logprobs=None, stream_options=None)
    assert chat.status_code == 200, chat.text
    nested = post(server, CHAT, messages=HELLO, max_tokens=2, stream=True, stream_options={"include_usage": None})
    assert nested.status_code == 200, nested.text


def test_integral_decimals_are_integers(server):
    """JSON Schema counts 3.0 as an integer (the fuzzer sends such), so strict types still take them."""
    as_decimals = post(server, COMPLETIONS, prompt=[9906.0, 11.0], max_tokens=3.0, n=1.0, temperature=0)
    as_integers = post(server, COMPLETIONS, prompt=[9906, 11], max_tokens=3, n=1, temperature=0)
    assert as_decimals.status_code == 200, as_decimals.text
    assert as_decimals.json()["choices"] == as_integers.json()["choices"]


def test_unknown_routes_get_an_error_body(server):
    response = requests.get(f"{server}/v1/engines", timeout=30)
    assert response.status_code == 404 and response.json()["error"]["type"] == "not_found_error"


def test_the_load_test_fails_when_its_time_ran_out_before_its_requests(server, capsys):
    """Zero requests ok and zero errors is not a passed load test: the requests never sent are named."""
    from pipelines import bench

    assert bench.main(["load", "--url", f"x={server}", "--requests", "3", "--max-seconds", "1e-9"]) == 1
    assert "error (x): 3 of the 3 requests were not sent before --max-seconds ran out" in capsys.readouterr().out


# -- concurrency -----------------------------------------------------------------------------------


def test_concurrent_requests_progress_together(server):
    """Two long streams started together: each receives text before the other finishes."""
    arrivals: dict[str, list[float]] = {"a": [], "b": []}

    def run(name: str, prompt: str) -> None:
        body = dict(prompt=prompt, max_tokens=60, temperature=0, stream=True)
        with requests.post(f"{server}{COMPLETIONS}", json=body, stream=True, timeout=120) as response:
            for line in response.iter_lines():
                if line and line != b"data: [DONE]":
                    arrivals[name].append(time.monotonic())

    threads = [threading.Thread(target=run, args=(name, prompt)) for name, prompt in
               [("a", "Alpha beta gamma"), ("b", "One two three four")]]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    a, b = arrivals["a"], arrivals["b"]
    assert len(a) > 10 and len(b) > 10
    assert max(a[0], b[0]) < min(a[-1], b[-1])  # both were streaming at the same time
    assert sum(a[0] < t < a[-1] for t in b) > len(b) // 2  # and b's chunks interleave with a's


def in_flight(server: str) -> int:
    return requests.get(f"{server}/health", timeout=30).json()["in_flight"]


def test_health_answers_busy_while_every_request_slot_is_taken(server, models):
    """Serve queues the health call behind generations. In an application of its own whose one
    replica holds one request, a long stream takes the slot: /health still answers, "busy", after its
    5 s wait, and "ok" once the stream is gone."""
    from ray import serve

    from pipelines.serve import ServeArgs, application

    args = ServeArgs(target=str(models / "target"), drafter=str(models / "drafter"), dtype="float64",
                     model_name="tiny")
    serve.run(application(args, max_ongoing_requests=1, num_replicas=1), name="saturated", route_prefix="/saturated")
    base = f"{server}/saturated"
    try:
        body = dict(prompt="Tell me everything", max_tokens=CONTEXT - 16, temperature=0, stream=True)
        with requests.post(f"{base}{COMPLETIONS}", json=body, stream=True, timeout=120) as response:
            lines = response.iter_lines()  # kept: a dropped iterator closes the connection
            assert next(lines)  # the stream holds the slot
            started = time.monotonic()
            health = requests.get(f"{base}/health", timeout=30)
            waited = time.monotonic() - started
        assert health.status_code == 200 and health.json() == {"status": "busy", "model": "tiny", "in_flight": None}
        assert 4 < waited < 10
        assert wait_for(lambda: requests.get(f"{base}/health", timeout=30).json()["status"] == "ok", timeout=30)
    finally:
        serve.delete("saturated")


def test_a_disconnected_stream_stops_its_generation(server):
    """A stream that would take about a minute is closed after two chunks: the replica drops it."""
    body = dict(prompt="Tell me everything", max_tokens=CONTEXT - 16, temperature=0, stream=True)
    with requests.post(f"{server}{COMPLETIONS}", json=body, stream=True, timeout=120) as response:
        lines = response.iter_lines()
        received = [line for line in (next(lines) for _ in range(4)) if line]
        assert len(received) == 2 and in_flight(server) == 1
    assert wait_for(lambda: in_flight(server) == 0, timeout=10)


def test_a_client_that_gives_up_waiting_stops_its_generation(server):
    body = dict(prompt="Tell me everything", max_tokens=CONTEXT - 16, temperature=0)
    with pytest.raises(requests.ReadTimeout):
        requests.post(f"{server}{COMPLETIONS}", json=body, timeout=(10, 2))
    assert wait_for(lambda: in_flight(server) == 0, timeout=10)


def test_metrics_reach_prometheus(server, ray_cluster):
    """Ray's metrics agent exports the replica's metrics, after one finished and one cancelled request."""
    finished = post(server, COMPLETIONS, prompt="Hello", max_tokens=8, temperature=0).json()
    body = dict(prompt="Hello", max_tokens=500, temperature=0, stream=True)
    with requests.post(f"{server}{COMPLETIONS}", json=body, stream=True, timeout=120) as response:
        next(response.iter_lines())
    port = ray_cluster.nodes()[0]["MetricsExportPort"]
    wanted = ["ray_domino_generated_tokens_total", "ray_domino_accept_length_bucket", "ray_domino_prefill_seconds",
              "ray_domino_draft_seconds",
              "ray_domino_verify_seconds", "ray_domino_queue_depth", 'finish_reason="cancelled"',
              'finish_reason="length"', 'ray_vllm_spec_decode_num_drafts_total{', 'model_name="tiny"',
              "ray_vllm_spec_decode_num_draft_tokens_total"]
    if finished["metrics"]["speculative_decoding"]["num_accepted_draft_tokens"]:
        wanted += ["ray_vllm_spec_decode_num_accepted_tokens_total",
                   'ray_vllm_spec_decode_num_accepted_tokens_per_pos_total{', 'position="0"']
    text = ""

    def exported() -> bool:
        nonlocal text
        text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
        return all(name in text for name in wanted)

    assert wait_for(exported, timeout=30, every=1), [name for name in wanted if name not in text]
    tokens = re.search(rf'^ray_domino_generated_tokens_total{{[^}}]*application="{APP}"[^}}]*}} (\S+)$',
                       text, re.MULTILINE)
    assert tokens and float(tokens.group(1)) >= finished["usage"]["completion_tokens"]
    # Ray exports a histogram's sum from its buckets' midpoints: each round's whole number of tokens must
    # come back whole, and at least one per round
    count, total = (float(re.search(rf'^ray_domino_accept_length_{part}{{[^}}]*application="{APP}"[^}}]*}} (\S+)$',
                                    text, re.MULTILINE).group(1)) for part in ("count", "sum"))
    assert total >= count > 0 and total == int(total), (total, count)


# -- isolation: one request never costs another its answer ----------------------------------------


def test_requests_that_once_failed_the_batch_leave_their_neighbours_alone(server):
    """A temperature so small that it underflowed to 0 made the sampling distribution NaN and failed
    every request on the replica. Sent beside healthy requests now, it is answered, and the healthy
    ones give exactly the tokens they give alone."""
    healthy = [dict(prompt="Alpha beta gamma", max_tokens=30, temperature=1.0, seed=11),
               dict(prompt="One two three four", max_tokens=30, temperature=0)]
    alone = [post(server, COMPLETIONS, **body).json()["choices"][0]["text"] for body in healthy]
    edges = [dict(prompt="Hello", max_tokens=12, temperature=1e-300),
             dict(prompt="Hi", max_tokens=12, temperature=5e-324),
             dict(messages=HELLO, max_tokens=12, temperature=1e-45, top_p=1e-300)]
    texts, statuses = [None, None], []

    def stream(i: int) -> None:
        texts[i] = streamed_text(events(server, COMPLETIONS, **healthy[i]))

    def edge(body: dict) -> None:
        statuses.append(post(server, CHAT if "messages" in body else COMPLETIONS, **body).status_code)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
    threads += [threading.Thread(target=edge, args=(body,)) for body in edges]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert statuses == [200, 200, 200] and texts == alone


# -- the openai SDK --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


def test_sdk_chat_completions_and_streaming(client, reference):
    messages = [{"role": "user", "content": "Name a colour."}]
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=20, temperature=0)
    expected = hf_greedy(reference, reference.encode_prompt(messages), 20)
    assert reply.choices[0].message.content == reference.tokenizer.decode(expected, skip_special_tokens=True)
    assert reply.usage.completion_tokens == len(expected)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=20, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reply.choices[0].message.content and chunks[-1].usage == reply.usage


def test_sdk_models_and_streamed_completions(client):
    import openai

    assert [m.id for m in client.models.list()] == ["tiny"] and client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError, match="'gpt-9' is not served here"):
        client.models.retrieve("gpt-9")
    whole = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=16, temperature=0)
    chunks = list(client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=16, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_sdk_completions_stop_seed_and_top_k(client):
    first = client.completions.create(model="tiny", prompt="Hello world", max_tokens=24, temperature=1.0, seed=5,
                                      extra_body={"top_k": 40})
    again = client.completions.create(model="tiny", prompt="Hello world", max_tokens=24, temperature=1.0, seed=5,
                                      extra_body={"top_k": 40})
    assert first.choices[0].text == again.choices[0].text
    text = first.choices[0].text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    cut = client.completions.create(model="tiny", prompt="Hello world", max_tokens=24, temperature=1.0, seed=5,
                                    stop=[stop], extra_body={"top_k": 40})
    assert cut.choices[0].text == text[: text.index(stop)] and cut.choices[0].finish_reason == "stop"
    assert cut.usage.completion_tokens < first.usage.completion_tokens


def test_sdk_logprobs_on_chat_and_completions(client, reference):
    messages = [{"role": "user", "content": "Count to five."}]
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                           logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    prompt_ids = reference.encode_prompt(messages)
    tokens = hf_greedy(reference, prompt_ids, 10)
    logp = torch.log_softmax(reference.model(torch.tensor([prompt_ids + tokens])).logits[0, len(prompt_ids) - 1: -1],
                             dim=-1)
    for j, entry in enumerate(content):
        assert entry.logprob == pytest.approx(float(logp[j, tokens[j]]), abs=1e-4)
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-6)
    completion = client.completions.create(model="tiny", prompt="Hello", max_tokens=6, temperature=0.8, seed=2,
                                           logprobs=2)
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == completion.usage.completion_tokens
    assert all(len(top) <= 2 for top in logprobs.top_logprobs) and all(v <= 0 for v in logprobs.token_logprobs)
    assert "".join(logprobs.tokens) == completion.choices[0].text


def test_sdk_logprob_bytes_rebuild_characters_split_across_tokens(client):
    """A token that holds part of a character reads as U+FFFD, but its `bytes` are its own (no UTF-8
    text on their own), so that the tokens' bytes join into the text: OpenAI's reason for the field."""
    def partial(entry) -> bool:
        try:
            bytes(entry.bytes).decode()
            return False
        except UnicodeDecodeError:
            return True

    for seed in range(20):  # sampling at temperature 2 soon draws such a token
        reply = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=32, temperature=2.0,
                                               seed=seed, logprobs=True, top_logprobs=2)
        content = reply.choices[0].logprobs.content
        if any(entry.token == "\ufffd" and partial(entry) for entry in content):
            break
    else:
        pytest.fail("no sampled token came with the bytes of part of a character")
    joined = b"".join(bytes(entry.bytes) for entry in content)
    assert joined.decode(errors="replace") == reply.choices[0].message.content
    for entry in content + [top for entry in content for top in entry.top_logprobs]:
        assert partial(entry) or bytes(entry.bytes) == entry.token.encode()
        assert not partial(entry) or entry.token == "\ufffd"


def test_sdk_n_choices_are_rows_with_their_own_seeds(client):
    kwargs = dict(model="tiny", messages=HELLO, max_tokens=12, temperature=1.0, seed=9)
    single = client.chat.completions.create(**kwargs)
    several = client.chat.completions.create(**kwargs, n=3)
    assert [c.index for c in several.choices] == [0, 1, 2]
    assert several.choices[0].message.content == single.choices[0].message.content  # choice 0 keeps the seed
    assert len({c.message.content for c in several.choices}) > 1
    metrics = several.model_extra["metrics"]
    assert several.usage.completion_tokens == metrics["new_tokens"]
    # the choices share their draft and verify forwards: timed once, within the request's wall time
    assert metrics["draft_s"] + metrics["verify_s"] <= metrics["total_s"], metrics
    streamed = list(client.chat.completions.create(**kwargs, n=3, stream=True))
    for i in range(3):
        text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices and c.choices[0].index == i)
        assert text == several.choices[i].message.content


def test_sdk_error_classes(client):
    import openai

    with pytest.raises(openai.BadRequestError, match="tools: not supported"):
        client.chat.completions.create(model="tiny", messages=HELLO, tools=[
            {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model="tiny", prompt="Hi", temperature=3)
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.chat.completions.create(model="gpt-9", messages=HELLO)


def test_what_openai_clients_send_unasked_is_accepted_where_it_changes_no_output(client):
    """Some clients send an end-user id, or zero penalties, on every request: refusing them broke those
    clients for nothing."""
    plain = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=8, temperature=0)
    tagged = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=8, temperature=0, user="alice",
                                            presence_penalty=0, frequency_penalty=0.0)
    assert tagged.choices[0].message.content == plain.choices[0].message.content
    text = client.completions.create(model="tiny", prompt="Hi", max_tokens=4, temperature=0, user="bob",
                                     presence_penalty=0.0).choices[0].text
    assert text == client.completions.create(model="tiny", prompt="Hi", max_tokens=4, temperature=0).choices[0].text


# -- the published schema against the live server ---------------------------------------------------


MAX_EXAMPLES = int(os.environ.get("DOMINO_FUZZ_EXAMPLES", "12"))  # per operation


def bounded(max_tokens) -> int:
    return min(max_tokens, 4) if type(max_tokens) is int and max_tokens > 0 else 4


def test_fuzzed_requests_get_no_server_error_and_conform_to_the_schema(server):
    """A bounded schemathesis run over every operation of the server's own /openapi.json (MAX_EXAMPLES
    each, $DOMINO_FUZZ_EXAMPLES for a longer run): no 5xx, every response conforms to the schema
    (status code, content type, body), and what the schema allows is accepted (it states the
    validation's limits, the served model's name, vocabulary and context included)."""
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (content_type_conformance, positive_data_acceptance,
                                                   response_schema_conformance, status_code_conformance)

    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
              positive_data_acceptance]
    published = requests.get(f"{server}/openapi.json", timeout=30).json()["components"]["schemas"]
    assert published["CompletionRequest"]["properties"]["prompt"]["anyOf"][1]["items"]["maximum"] == 49151
    schema = schemathesis.openapi.from_url(f"{server}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health"}
    for operation in operations:
        @given(case=operation.as_strategy())
        @settings(max_examples=MAX_EXAMPLES, deadline=None, phases=[Phase.generate], database=None,
                  suppress_health_check=list(HealthCheck))
        def check(case) -> None:
            if isinstance(case.body, dict):  # bounded generations, so the run takes seconds
                case.body["max_tokens"] = bounded(case.body.get("max_tokens"))
                if "max_completion_tokens" in case.body:
                    case.body["max_completion_tokens"] = bounded(case.body["max_completion_tokens"])
            case.call_and_validate(base_url=server, checks=checks)

        check()


# -- recovery ----------------------------------------------------------------------------------------


def replica_pids(ray_cluster) -> list[int]:
    """The process ids of the live engine replicas (asked of each replica actor itself)."""
    names = [a["name"] for a in ray_cluster.util.list_named_actors(all_namespaces=True)
             if a["name"].startswith(f"SERVE_REPLICA::{APP}#EngineReplica#")]
    handles = [ray_cluster.get_actor(name, namespace="serve") for name in names]
    return ray_cluster.get([handle.__ray_call__.remote(lambda replica: os.getpid()) for handle in handles])


def test_a_killed_replica_ends_its_stream_and_the_deployment_recovers(server, ray_cluster):
    (pid,) = replica_pids(ray_cluster)
    body = dict(prompt="Tell me everything", max_tokens=CONTEXT - 16, temperature=0, stream=True)
    received = []
    with requests.post(f"{server}{COMPLETIONS}", json=body, stream=True, timeout=120) as response:
        for line in response.iter_lines():  # a broken connection would raise here
            if line:
                received.append(line)
            if len(received) == 3:
                os.kill(pid, signal.SIGKILL)
    assert len(received) > 3 and b"data: [DONE]" not in received
    last = json.loads(received[-1].removeprefix(b"data: "))
    assert last["error"]["type"] == "server_error" and "engine replica failed" in last["error"]["message"], last
    started = time.monotonic()
    assert wait_for(lambda: healthy(server), timeout=90, every=1)
    assert replica_pids(ray_cluster) != [pid]
    print(f"recovered in {time.monotonic() - started:.1f} s")


def healthy(server: str) -> bool:
    try:
        return post(server, COMPLETIONS, prompt="Hello", max_tokens=2, temperature=0).status_code == 200
    except requests.RequestException:
        return False


# -- autoscaling (last: it starts a second replica) ------------------------------------------------


def running_replicas() -> int:
    from ray import serve

    deployment = serve.status().applications[APP].deployments["EngineReplica"]
    return deployment.replica_states.get("RUNNING", 0)


def test_sustained_load_scales_out_to_two_replicas_and_back(server):
    assert running_replicas() == 1
    stop = threading.Event()
    failures = []

    def client() -> None:
        while not stop.is_set():
            response = post(server, COMPLETIONS, prompt="Keep the replicas busy", max_tokens=30, temperature=0)
            if response.status_code != 200:
                failures.append(response.text)

    clients = [threading.Thread(target=client) for _ in range(8)]
    for thread in clients:
        thread.start()
    try:
        scaled_out = wait_for(lambda: running_replicas() == 2, timeout=90, every=0.5)
    finally:
        stop.set()
        for thread in clients:
            thread.join()
    assert scaled_out and not failures
    assert wait_for(lambda: running_replicas() == 1, timeout=60, every=0.5)
