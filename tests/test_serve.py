"""The Serve application end to end: a real Serve instance on the session's local Ray cluster, real
HTTP on a free loopback port, one deployment shared by every test.

The target is a tiny random Llama with SmolLM2's tokenizer and chat template, run in float64 (no
argmax near-ties between a block forward and a one-token forward), with a random drafter checkpoint.
"""

import json
import re
import shutil
import socket
import threading
import time
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
    serve.run(application(args, autoscaling_config=AUTOSCALING), name=APP, route_prefix="/")
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
    assert body["domino"]["rounds"] >= 1 and body["domino"]["tau"] >= 1.0


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
    ("/v1/completions", dict(prompt="Hello world", max_tokens=40, temperature=0)),
    ("/v1/completions", dict(prompt=[1, 2, 3, 4], max_tokens=40, temperature=0.9, top_p=0.9, top_k=50, seed=7)),
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "Hi"}], max_tokens=40, temperature=0)),
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
                                  max_tokens=40, temperature=1.2, seed=3)),
])
def test_streamed_chunks_concatenate_to_the_full_text(server, path, body):
    full = post(server, path, **body).json()
    chunks = events(server, path, **body)
    text = full["choices"][0]["text" if "text" in full["choices"][0] else "message"]
    text = text["content"] if isinstance(text, dict) else text
    assert streamed_text(chunks) == text
    last = chunks[-1]
    assert last["choices"][0]["finish_reason"] == full["choices"][0]["finish_reason"]
    assert last["usage"] == full["usage"]
    assert last["domino"]["tau"] == full["domino"]["tau"]
    assert all("usage" not in chunk for chunk in chunks[:-1])


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
    (COMPLETIONS, dict(prompt="Hello", max_tokens=CONTEXT), 400, None, "exceeds the target's context"),
    (COMPLETIONS, dict(prompt="Hello", temperature=2.5), 400, "temperature", "less than or equal to 2"),
    (COMPLETIONS, dict(prompt="Hello", temperature=-1), 400, "temperature", "greater than or equal to 0"),
    (COMPLETIONS, dict(prompt="Hello", top_p=0), 400, "top_p", "greater than 0"),
    (COMPLETIONS, dict(prompt="Hello", n=2), 400, "n", "less than or equal to 1"),
    (COMPLETIONS, dict(prompt="word " * CONTEXT), 400, None, "but the target's context holds 2048"),
    (CHAT, dict(messages=[{"role": "user", "content": "word " * CONTEXT}]), 400, None, "context holds 2048"),
    (COMPLETIONS, dict(prompt=""), 400, None, "the prompt is empty"),
    (COMPLETIONS, dict(prompt=[5, 49152]), 400, "prompt", "token ids must lie in 0..49151"),
    (COMPLETIONS, dict(max_tokens=5), 400, "prompt", "Field required"),
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
    assert message in error["message"] and error["param"] == param
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    good = post(server, path if path == COMPLETIONS else CHAT, max_tokens=2, temperature=0,
                **({"prompt": "Hello"} if path == COMPLETIONS else {"messages": HELLO}))
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] >= 1


def test_unknown_routes_get_an_error_body(server):
    response = requests.get(f"{server}/v1/engines", timeout=30)
    assert response.status_code == 404 and response.json()["error"]["type"] == "not_found_error"


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
    wanted = ["ray_domino_generated_tokens_total", "ray_domino_accept_length_bucket", "ray_domino_draft_seconds",
              "ray_domino_verify_seconds", "ray_domino_queue_depth", 'finish_reason="cancelled"',
              'finish_reason="length"']
    text = ""

    def exported() -> bool:
        nonlocal text
        text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
        return all(name in text for name in wanted)

    assert wait_for(exported, timeout=30, every=1), [name for name in wanted if name not in text]
    tokens = re.search(rf'^ray_domino_generated_tokens_total{{[^}}]*application="{APP}"[^}}]*}} (\S+)$',
                       text, re.MULTILINE)
    assert tokens and float(tokens.group(1)) >= finished["usage"]["completion_tokens"]


# -- autoscaling (last: it starts a second replica) ------------------------------------------------


def running_replicas() -> int:
    from ray import serve

    deployment = serve.status().applications[APP].deployments["OpenAIServer"]
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
