"""ServeConfig: limits and batching of the translation service (``aiayn serve``)."""
from __future__ import annotations

from dataclasses import dataclass

from aiayn.config import ConfigError, param


@dataclass(frozen=True)
class ServeConfig:
    """HTTP address, request limits (answered with 4xx errors) and the batching worker's settings."""

    host: str = param("127.0.0.1", "address to listen on (0.0.0.0 for every interface)")
    port: int = param(8000, "TCP port to listen on")
    max_sentences: int = param(32, "most sentences in one request (more: 413)")
    max_sentence_tokens: int = param(200, "most subword tokens in one source sentence, EOS included (more: 422)")
    max_request_bytes: int = param(65536, "largest request body in bytes (more: 413)")
    max_beam: int = param(16, "largest beam size a request may ask for (more: 422)")
    max_queue_sentences: int = param(2048, "sentences waiting for the model at most; a request beyond this gets 503")
    batch_wait_ms: float = param(5.0, "the batching worker waits this long after a request for more to join its model call")
    batch_tokens: int = param(4096, "source tokens (padding included) per model call; requests are collected up to this")
    threads: int = param(0, "torch intra-op threads (0 = torch's default)")

    def __post_init__(self) -> None:
        for name in ("max_sentences", "max_sentence_tokens", "max_request_bytes", "max_beam",
                     "max_queue_sentences", "batch_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.batch_wait_ms < 0 or self.threads < 0 or not 0 <= self.port < 65536:
            raise ConfigError("batch_wait_ms and threads must be >= 0 and port in [0, 65535]")
