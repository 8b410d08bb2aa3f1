"""The OpenAI-compatible HTTP API (issue 17) against real services on loopback and a real
redis-server: the official `openai` SDK (chat and completions, streaming and not) gets the
greedy output of plain decoding, right usage counts, and its own exception types for errors;
raw HTTP checks the error bodies, tokens and TLS; a client that disconnects stops the work."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import ssl
import sys

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from coordinator.servicer import start_coordinator_server
from specdec.decode import plain_generate
from specdec.testing import perturbed_copy, tiny_llama
from specdec.app.launcher import free_port
from specdec.rpc.security import ServerTLS, token_hash
from specdec.rpc.serving import ServerSettings
from specdec.types import StopConditions
from tests.conftest import gguf_copy
from tests.services.stack import FAST, TEXT_VOCAB, local_stack, run, save_char_tokenizer, slow
from tests.tlscerts import make_ca

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
TEXT = "Once upon a time"
TOKEN = "http-token-0123456789"


@pytest.fixture(scope="module")
def text_models(tmp_path_factory):
    """A tiny target with a character tokenizer (no EOS: answers run to max_tokens) and a draft."""
    lm = tiny_llama(seed=0, vocab_size=TEXT_VOCAB, num_layers=2, hidden_size=48, eos_token_id=None)
    return lm, perturbed_copy(lm, noise=0.05, seed=3), save_char_tokenizer(tmp_path_factory.mktemp("char-tok"))


def _expected(lm, tokenizer_dir, n: int, chat=None, text=None) -> tuple[str, int, str, int]:
    """(plain decoding's text, the prompt's token count, its finish reason and generated token
    count) for the same prompt, in process."""
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    if chat is not None:
        ids = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "input_ids") else ids)
    else:
        ids = list(tok(text, add_special_tokens=True)["input_ids"])
    out = plain_generate(lm, [ids], stop=StopConditions(max_new_tokens=n, eos_token_ids=lm.eos_token_ids))[0]
    return tok.decode(list(out.token_ids), skip_special_tokens=True), len(ids), out.finish_reason, len(out.token_ids)


def _sdk(st, key: str = "unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=st.coord.http.url + "/v1", api_key=key, max_retries=0, timeout=60)


async def _model(st) -> str:
    return (await st.core.info()).name


# --- the SDK: greedy output, usage, streaming ----------------------------------------------------

@pytest.mark.parametrize("backend,method", [("torch", "draft"), ("torch", "plain"), ("llamacpp", "auto"),
                                            ("llamacpp", "draft")])
def test_sdk_chat_and_completions_equal_plain_decoding_streaming_and_not(redis_url, text_models, tmp_path, backend,
                                                                         method):
    lm, draft, tokenizer_dir = text_models
    if backend == "llamacpp":  # the same weights as a GGUF on llama.cpp: text works there too
        lm = gguf_copy(lm, tmp_path / "text.gguf", context=512)
    n = 24

    async def scenario():
        async with local_stack(redis_url, lm, draft, http_port=0, tokenizer_dir=tokenizer_dir) as st:
            sdk, model = _sdk(st), await _model(st)
            ext = {"specdec": {"method": method}}
            chat = await sdk.chat.completions.create(model=model, messages=CHAT, max_tokens=n, temperature=0,
                                                     extra_body=ext)
            text = await sdk.completions.create(model=model, prompt=TEXT, max_tokens=n, temperature=0,
                                                extra_body=ext)
            chat_chunks = [c async for c in await sdk.chat.completions.create(
                model=model, messages=CHAT, max_tokens=n, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body=ext)]
            text_chunks = [c async for c in await sdk.completions.create(
                model=model, prompt=TEXT, max_tokens=n, temperature=0, stream=True, extra_body=ext)]
            models = await sdk.models.list()
            await sdk.close()
            return chat, text, chat_chunks, text_chunks, models, model

    chat, text, chat_chunks, text_chunks, models, model = run(scenario())
    # (The GGUF copy stops at an EOS id, which the torch model has none of: its answers may be shorter.)
    want_chat, chat_prompt, chat_finish, chat_n = _expected(lm, tokenizer_dir, n, chat=CHAT)
    want_text, text_prompt, text_finish, text_n = _expected(lm, tokenizer_dir, n, text=TEXT)
    assert chat.choices[0].message.content == want_chat and chat.choices[0].message.role == "assistant"
    assert text.choices[0].text == want_text
    assert (chat.choices[0].finish_reason, text.choices[0].finish_reason) == (chat_finish, text_finish)
    assert backend == "llamacpp" or chat_finish == text_finish == "length"
    assert (chat.usage.prompt_tokens, chat.usage.completion_tokens, chat.usage.total_tokens) == \
           (chat_prompt, chat_n, chat_prompt + chat_n)
    assert (text.usage.prompt_tokens, text.usage.completion_tokens) == (text_prompt, text_n)
    stats = chat.model_extra["specdec"]
    assert stats["method"] == method and stats["emitted"] == chat_n and stats["target_forwards"] >= 1
    assert stats["tokens"] == chat_n and len(stats["session_id"]) >= 8
    if method == "draft":
        assert stats["drafted"] > 0 and 0 < stats["alpha"] <= 1 and stats["tau"] > 1

    assert "".join(c.choices[0].delta.content or "" for c in chat_chunks if c.choices) == want_chat
    assert chat_chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chat_chunks if c.choices][-1] == chat_finish
    assert chat_chunks[-1].choices == [] and chat_chunks[-1].usage.completion_tokens == chat_n
    assert chat_chunks[-1].usage.prompt_tokens == chat_prompt
    assert all(c.usage is None for c in chat_chunks[:-1])
    assert "".join(c.choices[0].text for c in text_chunks) == want_text
    assert text_chunks[-1].choices[0].finish_reason == text_finish and text_chunks[-1].usage is None

    assert [m.id for m in models.data] == [model]
    assert {"auto", "draft", "plain"} <= set(models.data[0].model_extra["specdec"]["methods"])


def test_a_session_named_in_the_extension_resumes_from_a_position(redis_url, text_models):
    lm, _, tokenizer_dir = text_models

    async def scenario():
        async with local_stack(redis_url, lm, http_port=0, tokenizer_dir=tokenizer_dir) as st:
            sdk, model = _sdk(st), await _model(st)
            kw = dict(model=model, prompt=TEXT, max_tokens=16, temperature=0)
            first = await sdk.completions.create(**kw, extra_body={"specdec": {"session_id": "http-resume-1"}})
            again = await sdk.completions.create(**kw, extra_body={"specdec": {"session_id": "http-resume-1",
                                                                              "resume_from": 10}})
            other = None
            try:  # the same session id with another prompt answers nothing else silently
                await sdk.completions.create(**{**kw, "prompt": "Another prompt"},
                                             extra_body={"specdec": {"session_id": "http-resume-1"}})
            except openai.ConflictError as exc:
                other = exc
            await sdk.close()
            return first, again, other

    first, again, other = run(scenario())
    want = _expected(lm, tokenizer_dir, 16, text=TEXT)[0]
    assert first.choices[0].text == want and first.model_extra["specdec"]["session_id"] == "http-resume-1"
    assert again.usage.completion_tokens == 6 and want.endswith(again.choices[0].text)
    assert 0 < len(again.choices[0].text) < len(want)
    assert other is not None and other.status_code == 409


def test_the_http_api_answers_without_nagles_wait_on_its_connections(redis_url, text_models):
    """The connections the OpenAI API accepts send with TCP_NODELAY: without it each response's
    body waited behind its headers for the client's delayed ACK, 40 ms a request (measured: a
    one-token chat completion took 72 ms through `specdec up`, 28 ms with it, llama-server 17)."""
    import socket

    lm, _, tokenizer_dir = text_models

    async def scenario():
        async with local_stack(redis_url, lm, http_port=0, tokenizer_dir=tokenizer_dir) as st:
            sdk, model = _sdk(st), await _model(st)
            await sdk.completions.create(model=model, prompt=TEXT, max_tokens=2, temperature=0)
            conns = list(st.coord.http.server.server_state.connections)  # (kept alive by the SDK's pool)
            flags = [c.transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
                     for c in conns]
            await sdk.close()
            return flags

    flags = run(scenario())
    assert flags and all(flags), flags


# --- errors: OpenAI's shape, the SDK's exception types ---------------------------------------------

def test_bad_input_unknown_model_and_overload_raise_the_sdks_exceptions(redis_url, text_models):
    lm, _, tokenizer_dir = text_models
    settings = dataclasses.replace(FAST, max_active=1)

    async def scenario():
        async with local_stack(redis_url, slow(lm, 20.0), settings=settings, http_port=0,
                               tokenizer_dir=tokenizer_dir) as st:
            sdk, model = _sdk(st), await _model(st)
            caught = {}

            async def expect(name, coro):
                try:
                    await coro
                except openai.APIStatusError as exc:
                    caught[name] = exc
                    return
                caught[name] = None

            chat = dict(model=model, messages=CHAT, max_tokens=4)
            await expect("n=2", sdk.chat.completions.create(**chat, n=2))
            await expect("temperature=5", sdk.chat.completions.create(**chat, temperature=5))
            await expect("no messages", sdk.chat.completions.create(model=model, messages=[], max_tokens=4))
            await expect("bad method", sdk.chat.completions.create(**chat, extra_body={"specdec": {"method": "x"}}))
            await expect("too long", sdk.completions.create(model=model, prompt=TEXT, max_tokens=10 ** 6))
            await expect("token out of vocabulary", sdk.completions.create(model=model, prompt=[5, 10 ** 6],
                                                                           max_tokens=4))
            await expect("unknown session", sdk.completions.create(
                model=model, prompt=TEXT, max_tokens=4, extra_body={"specdec": {"session_id": "no-such-session",
                                                                                 "resume_from": 3}}))
            await expect("unknown model", sdk.chat.completions.create(**{**chat, "model": "gpt-4o"}))
            await expect("unknown model, retrieve", sdk.models.retrieve("gpt-4o"))
            # One generation is the limit: a second one while it runs is refused (429).
            busy = await sdk.completions.create(model=model, prompt=TEXT, max_tokens=200, temperature=0, stream=True)
            await busy.__anext__()
            await expect("overloaded", sdk.completions.create(model=model, prompt="x y", max_tokens=4))
            await busy.close()
            async with httpx.AsyncClient(base_url=st.coord.http.url, timeout=30) as http:
                raw = {"malformed json": await http.post("/v1/chat/completions", content=b"{not json",
                                                         headers={"content-type": "application/json"}),
                       "no model": await http.post("/v1/completions", json={"prompt": "hi"}),
                       "unknown path": await http.get("/v1/nothing-here")}
            await sdk.close()
            return caught, raw

    caught, raw = run(scenario())
    for name in ("n=2", "temperature=5", "no messages", "bad method", "too long", "token out of vocabulary"):
        assert isinstance(caught[name], openai.BadRequestError), (name, caught[name])
    for name in ("unknown session", "unknown model", "unknown model, retrieve"):
        assert isinstance(caught[name], openai.NotFoundError), (name, caught[name])
    assert isinstance(caught["overloaded"], openai.RateLimitError), caught["overloaded"]
    assert "gpt-4o" in caught["unknown model"].message and caught["unknown model"].type == "not_found_error"
    assert caught["n=2"].param is None and "n must be 1" in caught["n=2"].message
    assert caught["temperature=5"].param == "temperature"
    for name, resp in raw.items():
        body = resp.json()
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, (name, body)
        assert "Traceback" not in resp.text and "Error(" not in resp.text
    assert raw["malformed json"].status_code == 400 and raw["no model"].status_code == 400
    assert raw["no model"].json()["error"]["param"] == "model" and raw["unknown path"].status_code == 404


def test_a_down_target_is_503_and_health_says_so(redis_url):
    async def scenario():
        coord = await start_coordinator_server(redis_url, [], [f"127.0.0.1:{free_port()}"], http_port=0,
                                               settings=dataclasses.replace(FAST, target_wait_s=0.5))
        try:
            sdk = openai.AsyncOpenAI(base_url=coord.http.url + "/v1", api_key="x", max_retries=0, timeout=30)
            try:
                await sdk.completions.create(model="any", prompt="hello", max_tokens=4)
                err = None
            except openai.APIStatusError as exc:
                err = exc
            await sdk.close()
            async with httpx.AsyncClient(base_url=coord.http.url, timeout=30) as http:
                health = await http.get("/health")
            return err, health
        finally:
            await coord.stop(0)

    err, health = run(scenario())
    assert isinstance(err, openai.InternalServerError) and err.status_code == 503, err
    assert err.type == "service_unavailable" and "no target replica" in err.message
    assert health.status_code == 503 and health.json() == {"status": "unavailable"}


# --- tokens and TLS: the gRPC port's ------------------------------------------------------------------

def test_bearer_tokens_and_tls_of_the_grpc_port_guard_the_http_port(redis_url, text_models, tmp_path):
    lm, _, tokenizer_dir = text_models
    tokens = tmp_path / "tokens"
    tokens.write_text(token_hash(TOKEN) + "\n")
    ca = make_ca(tmp_path)
    cert, key = ca.issue("coordinator")
    outer = ServerSettings(token_file=str(tokens), tls=ServerTLS(cert, key))
    trust = ssl.create_default_context(cafile=ca.cert)

    async def scenario():
        async with local_stack(redis_url, lm, outer=outer, token=TOKEN, http_port=0, tokenizer_dir=tokenizer_dir) as st:
            url = st.coord.http.url
            model = await _model(st)

            async def sdk_call(key):
                sdk = openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=30,
                                         http_client=openai.DefaultAsyncHttpxClient(verify=trust))
                try:
                    return await sdk.completions.create(model=model, prompt=TEXT, max_tokens=5, temperature=0)
                except openai.APIStatusError as exc:
                    return exc
                finally:
                    await sdk.close()

            good, wrong = await sdk_call(TOKEN), await sdk_call("wrong-token")
            async with httpx.AsyncClient(base_url=url, verify=trust, timeout=30) as http:
                missing = await http.post("/v1/completions", json={"model": model, "prompt": "hi"})
                health = await http.get("/health")
                models = await http.get("/v1/models")
                metrics = (await http.get("/metrics"),
                           await http.get("/metrics", headers={"Authorization": f"Bearer {TOKEN}"}))
            plaintext = None
            try:
                async with httpx.AsyncClient(timeout=10) as http:
                    await http.get(url.replace("https://", "http://") + "/health")
            except httpx.HTTPError as exc:
                plaintext = exc
            return url, good, wrong, missing, health, models, metrics, plaintext

    url, good, wrong, missing, health, models, metrics, plaintext = run(scenario())
    assert url.startswith("https://")
    assert good.choices[0].text == _expected(lm, tokenizer_dir, 5, text=TEXT)[0]
    assert isinstance(wrong, openai.AuthenticationError) and wrong.status_code == 401
    assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
    assert missing.json()["error"]["type"] == "authentication_error"
    assert models.status_code == 401 and metrics[0].status_code == 401
    assert metrics[1].status_code == 200 and "specdec_generated_tokens_total 5.0" in metrics[1].text
    assert health.status_code == 200, "health needs no token"
    assert plaintext is not None, "plaintext HTTP was answered on a TLS port"


# --- a client that goes away stops the work ----------------------------------------------------------

def _forwards(st) -> float:
    """Model forwards the target ran so far (its batch-size histogram's count)."""
    samples = {s.name.rsplit("_", 1)[-1]: s.value for s in st.targets[0].metrics.batch_size.collect()[0].samples}
    return samples["count"]


async def _settled(st, timeout: float = 10.0) -> float:
    """The target's forward count once the coordinator holds no live run (bounded)."""
    async with asyncio.timeout(timeout):
        while st.core.runs:
            await asyncio.sleep(0.05)
    return _forwards(st)


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_stops_generation_on_the_target(redis_url, text_models, stream):
    lm, _, tokenizer_dir = text_models
    max_tokens = 400

    async def scenario():
        async with local_stack(redis_url, slow(lm, 20.0), http_port=0, tokenizer_dir=tokenizer_dir) as st:
            body = {"model": await _model(st), "prompt": TEXT, "max_tokens": max_tokens, "temperature": 0,
                    "stream": stream, "specdec": {"session_id": f"http-cut-{stream}"}}
            async with httpx.AsyncClient(base_url=st.coord.http.url, timeout=30) as http:
                if stream:
                    async with http.stream("POST", "/v1/completions", json=body) as resp:
                        events = 0
                        async for line in resp.aiter_lines():
                            events += line.startswith("data: ")
                            if events == 3:
                                break  # leaving the block closes the connection
                else:
                    call = asyncio.ensure_future(http.post("/v1/completions", json=body))
                    async with asyncio.timeout(20):
                        while _forwards(st) < 5:
                            await asyncio.sleep(0.02)
                    call.cancel()
            at_cut = await _settled(st)
            await asyncio.sleep(1.0)  # ~50 forwards' time at 20 ms each, had the run gone on
            later = _forwards(st)
            status = (await st.core.store.load(f"http-cut-{stream}")).status
            return at_cut, later, status

    at_cut, later, status = run(scenario())
    assert later == at_cut, "the target kept running forwards after the client left"
    assert at_cut < max_tokens / 2 and status == "paused"


# --- the published OpenAPI document, fuzzed ---------------------------------------------------------

def test_schemathesis_finds_no_server_error_and_every_response_matches_the_schema(redis_url, text_models,
                                                                                 tmp_path):
    lm, _, tokenizer_dir = text_models
    tokens = tmp_path / "tokens"
    tokens.write_text(token_hash(TOKEN) + "\n")

    async def scenario():
        async with local_stack(redis_url, lm, outer=ServerSettings(token_file=str(tokens)), token=TOKEN,
                               http_port=0, tokenizer_dir=tokenizer_dir) as st:
            await st.core.info()
            proc = await asyncio.create_subprocess_exec(
                os.path.join(os.path.dirname(sys.executable), "schemathesis"), "run",
                st.coord.http.url + "/openapi.json", "-H", f"Authorization: Bearer {TOKEN}",
                "--checks", "not_a_server_error,status_code_conformance,content_type_conformance,"
                            "response_schema_conformance",
                "--max-examples", "25", "--seed", "17", "--workers", "1", "--generation-database", "none",
                "--request-timeout", "30", "--no-color", "--phases", "examples,coverage,fuzzing",
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, cwd=str(tmp_path),
                env=dict(os.environ, OMP_NUM_THREADS="1"))
            out, _ = await asyncio.wait_for(proc.communicate(), 400)
            return proc.returncode, out.decode(errors="replace"), st.core.metrics.generated_tokens._value.get()

    code, out, generated = run(scenario(), timeout=450)
    assert code == 0, out[-6000:]
    assert generated > 0, "no fuzzed request reached generation"
