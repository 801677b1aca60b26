"""ServeConfig: limits, time bounds, access rules and batching of the translation service (``aiayn serve``)."""
from __future__ import annotations

import dataclasses
import ipaddress
import re
from dataclasses import dataclass

from aiayn.config import ConfigError, param
from aiayn.serve.clients import Network, trusted_networks

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]")  # Host header names of this machine


def is_loopback(host: str) -> bool:
    """Whether the listening address ``host`` is only reachable from this machine."""
    try:
        return host == "localhost" or ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


# what --allow-host and --allow-origin entries may be (``ServeConfig``): a Host name without its port
# (an IPv6 address in brackets, as a Host header writes it), and an Origin header's scheme://host[:port]
HOST_NAME = re.compile(r"[A-Za-z0-9_.-]+|\[[0-9A-Fa-f:.]+\]", re.ASCII)
ORIGIN = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://(?:[A-Za-z0-9_.-]+|\[[0-9A-Fa-f:.]+\])(?::[0-9]{1,5})?/?", re.ASCII)


@dataclass(frozen=True)
class ServeConfig:
    """HTTP address, request limits (answered with 4xx errors), time bounds, access rules and the
    batching worker's settings."""

    host: str = param("127.0.0.1", "address to listen on (0.0.0.0 for every interface)")
    port: int = param(8000, "TCP port to listen on")
    model_name: str = param("", "the model's name on the web page and in /health; empty = the checkpoint's file name "
                                 "(several: their names joined by +)")
    languages: str = param(
        "", "the model's language pair as SRC-TGT (e.g. en-de), shown on the web page and in /health; empty = "
            "none shown (checkpoints do not record their languages)")
    max_sentences: int = param(32, "most sentences in one request (more: 413)")
    max_sentence_tokens: int = param(200, "most subword tokens in one source sentence, EOS included (more: 422)")
    max_request_bytes: int = param(65536, "largest request body in bytes (more: 413)")
    max_beam: int = param(16, "largest beam size a request may ask for (more: 422)")
    max_alpha: float = param(10.0, "largest length penalty alpha a request may ask for (more: 422)")
    max_prefix_tokens: int = param(
        200, "most target subword tokens in one sentence's prefix (more: 422); a prefix raises its sentence's "
             "output limit to its length + 1")
    max_no_repeat_ngram: int = param(
        8, "largest no_repeat_ngram a request may ask for (more: 422); a step's ban costs beams x output length "
           "x n comparisons; 0 = requests cannot turn it on")
    max_attention_values: int = param(
        250_000, "most attention weights computed for one answer (every map, though only cross-attention is "
                 "returned); sentences past it get null attention; 0 = never returned (docs/serve.md)")
    max_queue_sentences: int = param(2048, "sentences waiting for the model at most; a request beyond this gets 503")
    max_queued_per_client: int = param(
        256, "sentences of one client waiting at most (at least max_sentences): beyond, 429 while others are "
             "served; behind a reverse proxy the proxy is one client unless named in forwarded_allow_ips")
    max_header_bytes: int = param(16384, "largest request head (request line and headers) in bytes (more: 431 or 400)")
    max_connections: int = param(64, "open client connections at most; more are answered 503 and closed")
    max_connections_per_client: int = param(
        16, "open connections from one client address at most; more are answered 429 and closed at once, and do "
            "not count against max_connections; behind a reverse proxy the proxy is the one client")
    client_requests_per_s: float = param(
        5.0, "requests per second one client address may send to /translate on average; faster ones wait (not "
             "refused) until its pace allows, a burst of client_burst passing at once; 0 = no pacing (docs/serve.md)")
    client_burst: int = param(20, "requests of one client address that pass at once before pacing holds them")
    forwarded_allow_ips: tuple[str, ...] = param(
        (), "addresses or networks (CIDR, comma separated) of trusted reverse proxies: a request from one of them is "
            "the client its X-Forwarded-For names (the right-most address there that is no trusted proxy); default: "
            "none, the header is ignored and a client is its peer address (docs/serve.md)")
    client_ipv6_prefix: int = param(
        64, "an IPv6 client is its address's first this many bits (a host may use any address of its /64); "
            "128 = each address a client of its own")
    header_timeout_s: float = param(10.0, "seconds a client has to send a request's headers (then 408 and closed)")
    body_timeout_s: float = param(10.0, "seconds a client has to send a request's body after its headers (then 408)")
    keep_alive_s: float = param(5.0, "seconds an idle keep-alive connection stays open")
    request_timeout_s: float = param(
        30.0, "deadline of a request from its arrival: a request not translated by then gets 503 and is not "
              "decoded (or its result is dropped)")
    shutdown_timeout_s: float = param(
        10.0, "on SIGTERM or Ctrl-C: new requests get 503, queued work is finished for this many seconds, the rest "
              "gets 503; a second Ctrl-C answers 503 at once and exits with status 130 (docs/serve.md)")
    allow_host: tuple[str, ...] = param(
        (), "Host header names accepted (comma separated; '*' = any); default: localhost names for a loopback "
            "address, any for other addresses")
    allow_origin: tuple[str, ...] = param(
        (), "browser origins (scheme://host:port, comma separated) allowed to call the API besides the "
            "service's own page; they get CORS headers")
    api_key: str = dataclasses.field(default="", repr=False, metadata={"help": (
        "a token clients must send (Authorization: Bearer KEY or X-API-Key: KEY) for /translate and /metrics; "
        "visible ASCII; empty = no token; better set through the AIAYN_API_KEY environment variable (not visible in "
        "ps)")})
    batch_wait_ms: float = param(5.0, "the batching worker waits this long after a request for more to join its model call")
    batch_tokens: int = param(
        4096, "tokens per model call: each sentence counts its source tokens plus the most its search may "
              "produce (max_len_a * source + max_len_b, or its prefix's length + 1)")
    concurrent_calls: int = param(
        2, "model calls at once, each in a worker thread sharing the model; a client has one in progress at most, "
           "so from 2 on its long calls never hold up others' (docs/serve.md)")
    yield_ms: float = param(
        250.0, "a model call waits up to this long before each decoding step while a call of clients that used the "
               "model less runs beside it (0 = calls share the machine; docs/serve.md)")
    threads: int = param(0, "torch intra-op threads (0 = torch's default)")

    def __post_init__(self) -> None:
        for name in ("max_sentences", "max_sentence_tokens", "max_request_bytes", "max_beam", "max_prefix_tokens",
                     "max_queue_sentences", "batch_tokens", "max_connections", "max_header_bytes",
                     "max_connections_per_client", "concurrent_calls", "client_burst"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_sentence_tokens < 2:  # the translator's max_input_tokens: one token besides EOS at least
            raise ConfigError(f"max_sentence_tokens must be >= 2 (a source token and EOS), got {self.max_sentence_tokens}")
        for name in ("header_timeout_s", "body_timeout_s", "keep_alive_s", "request_timeout_s", "shutdown_timeout_s"):
            if not 0 < getattr(self, name) < 1e6:
                raise ConfigError(f"{name} must be > 0 (seconds), got {getattr(self, name)}")
        if not 0 <= self.max_alpha < 1e6 or self.max_attention_values < 0 or self.max_no_repeat_ngram < 0:
            raise ConfigError("max_alpha, max_attention_values and max_no_repeat_ngram must be >= 0")
        if self.batch_wait_ms < 0 or self.yield_ms < 0 or self.threads < 0 or not 0 <= self.port < 65536:
            raise ConfigError("batch_wait_ms, yield_ms and threads must be >= 0 and port in [0, 65535]")
        if not 0 <= self.client_requests_per_s < 1e6:
            raise ConfigError(f"client_requests_per_s must be in [0, 1e6), got {self.client_requests_per_s}")
        if self.max_queued_per_client < self.max_sentences:
            raise ConfigError(f"max_queued_per_client ({self.max_queued_per_client}) must be >= max_sentences "
                              f"({self.max_sentences}): a full request must fit a client's share")
        if not 1 <= self.client_ipv6_prefix <= 128:
            raise ConfigError(f"client_ipv6_prefix must be in [1, 128] (bits), got {self.client_ipv6_prefix}")
        trusted_networks(self.forwarded_allow_ips)  # a ConfigError naming a bad entry
        # the guard compares a request's Host name (its port dropped) and its Origin with these as
        # written: an entry of another form would never match, every request refused 403
        for entry in self.allow_host:
            if entry != "*" and not HOST_NAME.fullmatch(entry):
                # (upper case: the command line rewrites the words host and port as its --host and --port)
                raise ConfigError(f"allow_host: {entry!r} is not a HOST name as a Host header gives it (like "
                                  "mt.example.org, 10.0.0.2 or [::1]; no scheme, path or :PORT: any PORT is "
                                  "accepted), nor '*'")
        for entry in self.allow_origin:
            if not ORIGIN.fullmatch(entry):
                raise ConfigError(f"allow_origin: {entry!r} is not a browser origin (SCHEME://HOST or "
                                  "SCHEME://HOST:PORT like https://tools.example, no path; each origin listed)")
        if self.api_key and not re.fullmatch(r"[!-~]+", self.api_key):  # (not echoed: it is a secret)
            raise ConfigError("api_key must be visible ASCII characters (no spaces, line breaks or accents): a header "
                              "loses its outer whitespace and a browser sends accented letters in another encoding "
                              "than curl, so such a key would refuse requests")
        if self.languages and not re.fullmatch(r"[A-Za-z]\w{0,15}-[A-Za-z]\w{0,15}", self.languages, re.ASCII):
            raise ConfigError(f"languages must be SRC-TGT like en-de, got {self.languages!r}")

    @property
    def language_pair(self) -> tuple[str, str] | None:
        """(source, target) from ``languages``, or None when it is not given."""
        if not self.languages:
            return None
        src, tgt = self.languages.split("-")
        return src, tgt

    @property
    def trusted_proxies(self) -> tuple[Network, ...]:
        """The networks of ``forwarded_allow_ips``: peers whose X-Forwarded-For is believed."""
        return trusted_networks(self.forwarded_allow_ips)

    @property
    def allowed_hosts(self) -> tuple[str, ...]:
        """The Host names accepted: ``allow_host``, or localhost names for a loopback bind, or any ('*')."""
        if self.allow_host:
            return self.allow_host
        if not is_loopback(self.host):
            return ("*",)
        return LOOPBACK_HOSTS if self.host in LOOPBACK_HOSTS else (*LOOPBACK_HOSTS, self.host)
