"""The HTTP JSON API and web page of ``aiayn serve`` (FastAPI).

    POST /translate  {"sentences": ["..."], "beam": 4, "alpha": 0.6, "nbest": 1, "attention": false, "prefix": ["..."]?,
                      "no_repeat_ngram": 0?}
                  -> {"translations": ["..."], "nbest": [[{"text", "score", "log_prob", "eos"}]] (nbest > 1),
                      "attention": [{"src_tokens", "tgt_tokens", "cross": (L,H,T,S)} or null] (attention: true),
                      "beam": 4, "alpha": 0.6, "time_ms": 12.3}
    GET  /health     {"status": "ok", "queued": 0, "model_calls": 7, "model": {"name", "languages", "parameters", ...},
                      "limits": {...}}
    GET  /metrics    counters in Prometheus' text format (metrics.py)
    GET  /           a page: type sentences, see translations, click to see the cross-attention map

Every error is ``{"error": MESSAGE}`` with a plain message (exceptions are logged, never echoed):
400 body not JSON, 401 API key missing or wrong, 403 Host or Origin not allowed, 408 body too slow,
413 body or sentence count too large, 415 not ``application/json``, 422 invalid fields, a
sentence or a prefix too long, 429 the client's share of the queue full (a client is a peer address,
an IPv6 one by its /64, or the address a trusted proxy forwards: clients.py),
503 queue full, deadline passed or shutting down, 500 anything else (logged;
the service keeps running). Translation runs in the ``Batcher``'s threads, shared by all
requests, fairly between clients; a request whose client hangs up before the model reaches it is
not decoded.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from typing import Sequence

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from aiayn.config import ConfigError, replace
from aiayn.decode.config import DecodeConfig
from aiayn.decode.translator import LongLineError, Translator
from aiayn.errors import InputError
from aiayn.model.transformer import count_preset_parameters
from aiayn.serve.batcher import Batcher, Busy, ClientBusy, Expired
from aiayn.serve.job import Job, Result
from aiayn.serve.clients import Network, client_address, client_key
from aiayn.serve.config import ServeConfig
from aiayn.serve.guard import Guard
from aiayn.serve.metrics import Metrics
from aiayn.serve.pace import Pacer
from aiayn.serve.page import index_html

log = logging.getLogger(__name__)


# the caps of every request field and of the work one request may cause, as /health reports them
LIMITS = ("max_sentences", "max_sentence_tokens", "max_request_bytes", "max_beam", "max_alpha", "max_prefix_tokens",
          "max_no_repeat_ngram", "max_attention_values", "max_queue_sentences", "max_queued_per_client", "batch_tokens",
          "request_timeout_s", "max_connections", "max_connections_per_client", "client_requests_per_s",
          "client_burst")


class ApiError(Exception):
    """A request the client must change: answered with ``status`` and ``{"error": message}``."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


class TranslateRequest(BaseModel):
    """The body of POST /translate; omitted decode settings take the server's defaults (§6.1).
    Strict: no strings for numbers or numbers for booleans; no NaN or infinity."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
    sentences: list[str]
    beam: int | None = Field(None, ge=1, description="beam size (greedy = 1)")
    alpha: float | None = Field(None, ge=0, description="length penalty α")
    nbest: int = Field(1, ge=1, description="hypotheses per sentence, best first")
    attention: bool = Field(False, description="return the encoder-decoder attention of each best output")
    prefix: list[str] | None = Field(None, description="one target prefix per sentence that its translations "
                                                       "begin with and the search continues (\"\" for none)")
    no_repeat_ngram: int | None = Field(None, ge=0, description="no n-gram of this many tokens twice in an output "
                                                                "(0 = off; DecodeConfig.no_repeat_ngram)")

    @field_validator("nbest", "attention", mode="before")
    @classmethod
    def _null_is_left_out(cls, value, info):
        """null for any optional field is the field left out, as it is for beam, alpha and prefix."""
        return cls.model_fields[info.field_name].default if value is None else value


def plain(text: str, limit: int = 300) -> str:
    """``text`` safe to send back: valid UTF-8 (lone surrogates replaced) and at most ``limit`` characters."""
    text = text.encode("utf-8", "replace").decode("utf-8")
    return text if len(text) <= limit else text[:limit] + "..."


def _validation_message(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors(include_url=False, include_input=False):
        where = "".join(f"[{x}]" if isinstance(x, int) else f".{plain(str(x), 40)}" for x in err["loc"])
        where = where.lstrip(".") or "body"  # sentences[0], as the service's other messages name an item
        parts.append(f"{where}: {err['msg']}")
    return "; ".join(parts[:5])


async def _read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The request body, refusing (413) more than ``limit`` bytes before reading them all and (408)
    a body that takes longer than ``timeout_s``."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the request body has {int(declared)} bytes; the limit is {limit}")
    body = bytearray()

    async def read() -> None:
        async for chunk in request.stream():
            body.extend(chunk)
            if len(body) > limit:
                raise ApiError(413, f"the request body exceeds the limit of {limit} bytes")
    try:
        await asyncio.wait_for(read(), timeout_s)  # (not asyncio.timeout: Python 3.11's, and 3.10 is supported)
    except asyncio.TimeoutError:  # (the built-in TimeoutError from Python 3.11 on; not yet in 3.10)
        raise ApiError(408, f"the request body did not arrive within {timeout_s:g} s") from None
    return bytes(body)


class _Constant(ValueError):
    """NaN, Infinity or -Infinity in a body: Python's json reads them, JSON has no such numbers."""


def _no_constant(name: str):
    raise _Constant(f"{name} is not JSON")


def _is_text(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _lone_surrogate(data: dict) -> str | None:
    """The error message for the first string of the parsed body, a field name or a value at any
    depth, that holds a lone surrogate (``"\\ud800"`` is valid JSON but no Unicode text: encoding it
    fails), naming where it is (``prefix[1]: ...``); None if none does. Every text field of a request
    gets this one check before any field is read."""
    stack: list[tuple[object, str]] = [(data, "body")]
    while stack:
        value, where = stack.pop()
        if isinstance(value, str) and not _is_text(value):
            return f"{where}: not valid Unicode text (a lone surrogate)"
        if isinstance(value, dict):
            for key in value:
                if not _is_text(key):
                    return f"{where}: a field name is not valid Unicode text (a lone surrogate)"
            stack.extend(reversed([(v, k if where == "body" else f"{where}.{k}") for k, v in value.items()]))
        elif isinstance(value, list):
            stack.extend(reversed([(v, f"{where}[{i}]") for i, v in enumerate(value)]))
    return None


def _parse(body: bytes) -> TranslateRequest:
    try:
        # a leading byte-order mark is not JSON's, but RFC 8259 lets a reader ignore it (as Windows tools send it)
        data = json.loads(body.decode("utf-8-sig"), parse_constant=_no_constant)
    except UnicodeDecodeError:
        raise ApiError(400, "the body is not JSON (it is not UTF-8 text)") from None
    except json.JSONDecodeError as exc:
        raise ApiError(400, f"the body is not JSON (line {exc.lineno}, column {exc.colno})") from None
    except _Constant:
        raise ApiError(400, "the body is not JSON (NaN and Infinity are not JSON numbers)") from None
    except ValueError:  # an integer of more digits than Python converts (sys.get_int_max_str_digits)
        raise ApiError(422, "the body holds a number of more digits than this service reads") from None
    except RecursionError:
        raise ApiError(400, "the body is not JSON this service reads: it is nested too deeply") from None
    if not isinstance(data, dict):
        raise ApiError(422, 'the body must be a JSON object like {"sentences": ["..."]}')
    if (problem := _lone_surrogate(data)) is not None:
        raise ApiError(422, problem)
    try:
        req = TranslateRequest.model_validate(data)
    except ValidationError as exc:
        raise ApiError(422, _validation_message(exc)) from None
    except RecursionError:
        raise ApiError(400, "the body is nested too deeply") from None
    return req


def _settings(req: TranslateRequest, base: DecodeConfig, cfg: ServeConfig) -> DecodeConfig:
    """The request's decode settings (server defaults where omitted), or an ApiError for a limit it breaks."""
    if not req.sentences:
        raise ApiError(422, "sentences: give at least one sentence")
    if len(req.sentences) > cfg.max_sentences:
        raise ApiError(413, f"sentences: {len(req.sentences)} sentences; the limit is {cfg.max_sentences} per request")
    beam = base.beam_size if req.beam is None else req.beam
    if beam > cfg.max_beam:
        raise ApiError(422, f"beam: {beam} exceeds the limit of {cfg.max_beam}")
    alpha = base.alpha if req.alpha is None else req.alpha
    if not (math.isfinite(alpha) and alpha <= cfg.max_alpha):
        raise ApiError(422, f"alpha: must be in [0, {cfg.max_alpha:g}]")
    if req.nbest > beam:  # (DecodeConfig's own check names its field, beam_size)
        raise ApiError(422, f"nbest: {req.nbest} exceeds beam ({beam}); give nbest <= beam")
    ngram = base.no_repeat_ngram if req.no_repeat_ngram is None else req.no_repeat_ngram
    if ngram > cfg.max_no_repeat_ngram:
        raise ApiError(422, f"no_repeat_ngram: {ngram} exceeds the limit of {cfg.max_no_repeat_ngram}")
    try:
        return replace(base, beam_size=beam, alpha=alpha, nbest=req.nbest, no_repeat_ngram=ngram)
    except ConfigError as exc:
        raise ApiError(422, plain(str(exc))) from None


async def _read_request(request: Request, cfg: ServeConfig, base: DecodeConfig, checker: Translator,
                        metrics: Metrics) -> tuple[TranslateRequest, DecodeConfig, list[list[int]], list | None]:
    """The checked body of POST /translate: the request, its decode settings, its source ids and
    its prefixes' target ids (None without prefixes)."""
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media != "application/json":
        raise ApiError(415, "send the body as Content-Type: application/json")
    try:
        body = await _read_body(request, cfg.max_request_bytes, cfg.body_timeout_s)
    except ClientDisconnect:
        metrics.events["client_gone"] += 1
        raise ApiError(499, "the client closed the connection") from None
    except ApiError as exc:
        metrics.events["body_timeout"] += exc.status == 408
        raise
    req = _parse(body)
    settings = _settings(req, base, cfg)
    try:
        ids = checker.encode(req.sentences, source="sentences", first_line=0)
    except LongLineError as exc:  # the server's limit, not translate's options
        raise ApiError(422, f"sentences[{exc.line}]: {exc.tokens} source tokens (EOS included) exceed the limit of "
                            f"{exc.limit} (the server's --max-sentence-tokens, or the model's max_positions with "
                            f"learned positions); split the sentence") from None
    except InputError as exc:
        raise ApiError(422, f"sentences[{exc.line}]: {str(exc).split(': ', 1)[1]}") from None
    if req.prefix is not None and len(req.prefix) != len(req.sentences):
        raise ApiError(422, f"prefix: {len(req.prefix)} prefixes for {len(req.sentences)} sentences")
    try:
        prefixes = checker.encode_prefixes(req.prefix, source="prefix", first_line=0)
    except InputError as exc:  # over a learned-positions model's max_positions
        raise ApiError(422, f"prefix[{exc.line}]: {str(exc).split(': ', 1)[1]}") from None
    for i, p in enumerate(prefixes or []):
        if len(p) > cfg.max_prefix_tokens:
            raise ApiError(422, f"prefix[{i}]: {len(p)} target tokens exceed the limit of {cfg.max_prefix_tokens}")
    return req, settings, ids, prefixes


def _client(request: Request, trusted: Sequence[Network], ipv6_prefix: int) -> str:
    """The key of the request's client (serve/clients.py): its peer address, or the address a trusted
    proxy forwarded, an IPv6 one by its network of ``ipv6_prefix`` bits."""
    peer = request.client.host if request.client else ""
    address = client_address(peer, request.headers.getlist("x-forwarded-for"), trusted) if trusted else peer
    return client_key(address, ipv6_prefix)


def _response(req: TranslateRequest, result: Result, settings: DecodeConfig, t0: float) -> bytes:
    """The JSON answer (run in a worker thread when it carries attention maps)."""
    out: dict = {"translations": [ts[0].text if ts else "" for ts in result.nbest]}
    if req.nbest > 1:
        out["nbest"] = [[{"text": t.text, "score": t.score, "log_prob": t.log_prob, "eos": t.eos} for t in ts]
                        for ts in result.nbest]
    if result.attention is not None:
        out["attention"] = [None if a is None else {
            "src_tokens": a["src_tokens"], "tgt_tokens": a["tgt_tokens"],
            "cross": np.round(a["cross"].astype(np.float64), 4).tolist()}  # (L,H,T,S); rounded as doubles: 0.2045, not 0.2045000046
            for a in result.attention]
    out.update(beam=settings.beam_size, alpha=settings.alpha, time_ms=round(1000 * (time.perf_counter() - t0), 2))
    return json.dumps(out, ensure_ascii=False, allow_nan=False).encode("utf-8")


async def _await_answer(request: Request, job: Job, timeout_s: float, metrics: Metrics) -> Result:
    """The job's result; if the client hangs up or the deadline passes first, the job is abandoned
    (not decoded if the model has not reached it) and an ApiError answers."""
    answer = asyncio.wrap_future(job.future)

    async def client_gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    gone = asyncio.ensure_future(client_gone())
    try:
        done, _ = await asyncio.wait({answer, gone}, timeout=max(0.0, timeout_s), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if answer in done:
        return answer.result()
    job.abandon()
    if gone in done:
        metrics.events["client_gone"] += 1
        raise ApiError(499, "the client closed the connection")
    metrics.events["deadline"] += 1
    raise ApiError(503, "the request was not translated within its deadline; retry later")


def _add_error_handlers(app: FastAPI) -> None:
    """Every error answer is {"error": message}; unexpected exceptions are logged and become 500."""

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse({"error": plain(exc.message)}, status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:  # 404, 405 (its Allow)
        return JSONResponse({"error": plain(str(exc.detail))}, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error on %s", request.url.path)
        return JSONResponse({"error": "internal error (logged by the service)"}, status_code=500)


def create_app(translator: Translator, cfg: ServeConfig = ServeConfig()) -> FastAPI:
    """The service around ``translator`` (its DecodeConfig gives the defaults of every request)."""
    # workers = 1: the service decodes in its own process (its parallelism is batching across requests)
    base = replace(translator.cfg, max_input_tokens=cfg.max_sentence_tokens, batch_tokens=cfg.batch_tokens, workers=1)
    checker = Translator(translator.models, translator.src_tok, translator.tgt_tok, base)  # encodes + length check
    batcher = Batcher(translator, wait_ms=cfg.batch_wait_ms,
                      batch_tokens=cfg.batch_tokens, max_queue_sentences=cfg.max_queue_sentences,
                      max_queued_per_client=cfg.max_queued_per_client, concurrent_calls=cfg.concurrent_calls,
                      yield_ms=cfg.yield_ms)
    metrics = Metrics()
    pacer = Pacer(cfg.client_requests_per_s, cfg.client_burst)
    trusted = cfg.trusted_proxies
    m = translator.model.cfg

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        batcher.start()
        yield
        await asyncio.to_thread(batcher.stop, 5.0)

    app = FastAPI(title="aiayn translation service", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.batcher, app.state.metrics = batcher, metrics
    app.add_middleware(Guard, cfg=cfg, metrics=metrics)
    _add_error_handlers(app)
    pair = cfg.language_pair
    health_body = {"model": {"name": cfg.model_name or None,
                             "languages": {"source": pair[0], "target": pair[1]} if pair else None,
                             "parameters": sum(count_preset_parameters(x.cfg) for x in translator.models),
                             "n_layers": m.n_layers, "n_heads": m.n_heads, "d_model": m.d_model,
                             "ensemble": len(translator.models)},
                   "defaults": {"beam": base.beam_size, "alpha": base.alpha, "no_repeat_ngram": base.no_repeat_ngram},
                   "limits": {k: getattr(cfg, k) for k in LIMITS}}

    @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD: load balancers' and curl -I's probe (no body)
    async def health() -> JSONResponse:
        # 503 while shutting down: a load balancer's probe reads the status code, and stops sending
        # requests here that would be refused
        status = "shutting down" if batcher.shutting_down else "ok"
        return JSONResponse({"status": status, "queued": batcher.queued, "queued_clients": batcher.queued_clients,
                             "model_calls": batcher.calls, "stopped_model_calls": batcher.stopped, **health_body},
                            status_code=503 if batcher.shutting_down else 200)

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def prometheus() -> Response:
        text = metrics.render(batcher.queued, batcher.calls, batcher.skipped, batcher.stopped)
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.api_route("/", methods=["GET", "HEAD"], response_class=HTMLResponse)
    async def page() -> str:
        return index_html(beam=base.beam_size, alpha=base.alpha, max_sentences=cfg.max_sentences,
                          key_input=bool(cfg.api_key), model=health_body["model"],
                          attention_values=cfg.max_attention_values)

    @app.post("/translate")
    async def translate(request: Request) -> Response:
        t0, arrived = time.perf_counter(), time.monotonic()
        client = _client(request, trusted, cfg.client_ipv6_prefix)
        deadline = arrived + cfg.request_timeout_s
        if (held := pacer.hold(client, arrived, limit=cfg.request_timeout_s)) > 0:  # faster than its pace
            metrics.events["client_paced"] += 1
            if held >= cfg.request_timeout_s:
                raise ApiError(429, f"more than {cfg.client_requests_per_s:g} requests a second from this address; "
                                    f"retry in {held:.0f} s")
            await asyncio.sleep(held)  # before any work is spent on it
        try:
            batcher.check_client(client)  # a full share is refused before the body is read and encoded
            req, settings, ids, prefixes = await _read_request(request, cfg, base, checker, metrics)
            job = batcher.submit(settings, ids, req.attention, attention_values=cfg.max_attention_values,
                                 deadline=deadline, prefixes=prefixes, client=client)
        except ClientBusy as exc:
            metrics.events["client_queue_full"] += 1
            raise ApiError(429, str(exc)) from None
        except Busy as exc:
            raise ApiError(503, str(exc)) from None
        try:
            result = await _await_answer(request, job, deadline - time.monotonic(), metrics)
        except (Busy, Expired) as exc:
            raise ApiError(503, str(exc)) from None
        if result.attention is None:
            return Response(_response(req, result, settings, t0), media_type="application/json")
        body = await asyncio.to_thread(_response, req, result, settings, t0)  # maps can be large
        return Response(body, media_type="application/json")

    return app
