"""The HTTP JSON API and web page of ``aiayn serve`` (FastAPI).

    POST /translate  {"sentences": ["..."], "beam": 4, "alpha": 0.6, "nbest": 1, "attention": false, "prefix": ["..."]?}
                  -> {"translations": ["..."], "nbest": [[{"text", "score", "log_prob", "eos"}]] (nbest > 1),
                      "attention": [{"src_tokens", "tgt_tokens", "cross": (L,H,T,S)}] (attention: true),
                      "beam": 4, "alpha": 0.6, "time_ms": 12.3}
    GET  /health     {"status": "ok", "queued": 0, "model_calls": 7, "model": {...}, "limits": {...}}
    GET  /           a page: type sentences, see translations, click to see the cross-attention map

Every error is ``{"error": MESSAGE}``: 400 body not JSON, 413 body or sentence count too large,
422 invalid fields or a sentence too long, 503 queue full, 500 anything else (logged; the
service keeps running). Translation runs in the ``Batcher``'s thread, shared by all requests.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from aiayn.config import ConfigError, replace
from aiayn.decode.config import DecodeConfig
from aiayn.decode.translator import Translator
from aiayn.errors import InputError
from aiayn.serve.batcher import Batcher, Busy, Result
from aiayn.serve.config import ServeConfig
from aiayn.serve.page import index_html

log = logging.getLogger(__name__)


class ApiError(Exception):
    """A request the client must change: answered with ``status`` and ``{"error": message}``."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


class TranslateRequest(BaseModel):
    """The body of POST /translate; omitted decode settings take the server's defaults (§6.1)."""

    model_config = ConfigDict(extra="forbid")
    sentences: list[str]
    beam: int | None = Field(None, ge=1, description="beam size (greedy = 1)")
    alpha: float | None = Field(None, ge=0, description="length penalty α")
    nbest: int = Field(1, ge=1, description="hypotheses per sentence, best first")
    attention: bool = Field(False, description="return the encoder-decoder attention of each best output")
    prefix: list[str] | None = Field(None, description="one target prefix per sentence that its translations "
                                                       "begin with and the search continues (\"\" for none)")


def _validation_message(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        where = ".".join(str(x) for x in err["loc"]) or "body"
        parts.append(f"{where}: {err['msg']}")
    return "; ".join(parts)


async def _read_body(request: Request, limit: int) -> bytes:
    """The request body, refusing (413) more than ``limit`` bytes before reading them all."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the request body has {declared} bytes; the limit is {limit}")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise ApiError(413, f"the request body exceeds the limit of {limit} bytes")
    return bytes(body)


def _parse(body: bytes) -> TranslateRequest:
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, ValueError) as exc:
        raise ApiError(400, f"the body is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ApiError(422, 'the body must be a JSON object like {"sentences": ["..."]}')
    try:
        return TranslateRequest.model_validate(data)
    except ValidationError as exc:
        raise ApiError(422, _validation_message(exc)) from None


def _settings(req: TranslateRequest, base: DecodeConfig, cfg: ServeConfig) -> DecodeConfig:
    """The request's decode settings (server defaults where omitted), or an ApiError for a limit it breaks."""
    if not req.sentences:
        raise ApiError(422, "sentences: give at least one sentence")
    if len(req.sentences) > cfg.max_sentences:
        raise ApiError(413, f"sentences: {len(req.sentences)} sentences; the limit is {cfg.max_sentences} per request")
    beam = base.beam_size if req.beam is None else req.beam
    if beam > cfg.max_beam:
        raise ApiError(422, f"beam: {beam} exceeds the limit of {cfg.max_beam}")
    try:
        return replace(base, beam_size=beam, alpha=base.alpha if req.alpha is None else req.alpha, nbest=req.nbest)
    except ConfigError as exc:
        raise ApiError(422, str(exc)) from None


def _response(req: TranslateRequest, result: Result, settings: DecodeConfig, t0: float) -> dict:
    out: dict = {"translations": [ts[0].text if ts else "" for ts in result.nbest]}
    if req.nbest > 1:
        out["nbest"] = [[{"text": t.text, "score": t.score, "log_prob": t.log_prob, "eos": t.eos} for t in ts]
                        for ts in result.nbest]
    if result.attention is not None:
        out["attention"] = [None if a is None else {
            "src_tokens": a["src_tokens"], "tgt_tokens": a["tgt_tokens"],
            "cross": np.round(a["cross"], 4).tolist()}  # (L,H,T,S)
            for a in result.attention]
    out.update(beam=settings.beam_size, alpha=settings.alpha, time_ms=round(1000 * (time.perf_counter() - t0), 2))
    return out


def _add_error_handlers(app: FastAPI) -> None:
    """Every error answer is {"error": message}; unexpected exceptions are logged and become 500."""

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse({"error": exc.message}, status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse({"error": str(exc.detail)}, status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error on %s", request.url.path)
        return JSONResponse({"error": f"internal error: {type(exc).__name__}: {exc}"}, status_code=500)


def create_app(translator: Translator, cfg: ServeConfig = ServeConfig()) -> FastAPI:
    """The service around ``translator`` (its DecodeConfig gives the defaults of every request)."""
    # workers = 1: the service decodes in its own process (its parallelism is batching across requests)
    base = replace(translator.cfg, max_input_tokens=cfg.max_sentence_tokens, batch_tokens=cfg.batch_tokens, workers=1)
    checker = Translator(translator.models, translator.src_tok, translator.tgt_tok, base)  # encodes + length check
    batcher = Batcher(translator.models, translator.src_tok, translator.tgt_tok, wait_ms=cfg.batch_wait_ms,
                      batch_tokens=cfg.batch_tokens, max_queue_sentences=cfg.max_queue_sentences)
    m = translator.model.cfg

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        batcher.start()
        yield
        await asyncio.to_thread(batcher.stop)

    app = FastAPI(title="aiayn translation service", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.batcher = batcher
    _add_error_handlers(app)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "queued": batcher.queued, "model_calls": batcher.calls,
                "model": {"n_layers": m.n_layers, "n_heads": m.n_heads, "d_model": m.d_model,
                          "ensemble": len(translator.models)},
                "defaults": {"beam": base.beam_size, "alpha": base.alpha},
                "limits": {k: getattr(cfg, k) for k in ("max_sentences", "max_sentence_tokens",
                                                        "max_request_bytes", "max_beam")}}

    @app.get("/", response_class=HTMLResponse)
    async def page() -> str:
        return index_html(beam=base.beam_size, alpha=base.alpha, max_sentences=cfg.max_sentences)

    @app.post("/translate")
    async def translate(request: Request) -> dict:
        t0 = time.perf_counter()
        req = _parse(await _read_body(request, cfg.max_request_bytes))
        settings = _settings(req, base, cfg)
        try:
            ids = checker.encode(req.sentences, source="sentences", first_line=0)
        except InputError as exc:
            raise ApiError(422, f"sentences[{exc.line}]: {str(exc).split(': ', 1)[1]}") from None
        if req.prefix is not None and len(req.prefix) != len(req.sentences):
            raise ApiError(422, f"prefix: {len(req.prefix)} prefixes for {len(req.sentences)} sentences")
        try:
            future = batcher.submit(settings, ids, req.attention, checker.encode_prefixes(req.prefix))
        except Busy as exc:
            raise ApiError(503, str(exc)) from None
        result = await asyncio.wrap_future(future)
        return _response(req, result, settings, t0)

    return app
