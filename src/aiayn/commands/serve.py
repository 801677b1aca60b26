"""``aiayn serve``: the translation service (HTTP JSON API and web page) for a checkpoint."""
from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from aiayn.config import ConfigError, add_arguments, from_args, replace
from aiayn.commands.decode_settings import decode_config
from aiayn.decode.config import CHECKPOINT_FIELDS, DecodeConfig, add_device_argument
from aiayn.errors import UserError
from aiayn.serve.config import ServeConfig

log = logging.getLogger(__name__)
API_KEY_ENV = "AIAYN_API_KEY"


SERVE_DECODE = ("beam_size", "alpha", "max_len_a", "max_len_b", "no_repeat_ngram")  # the request's defaults
SERVE_MODEL = ("precision", "cuda_graphs")  # how the server's model decodes every request (docs/serve.md)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve", help="serve a checkpoint over HTTP: POST /translate, GET /health, a web page at /",
        description="Translation service. POST /translate with {\"sentences\": [...], \"beam\": 4, \"alpha\": 0.6, "
                    "\"nbest\": 1, \"attention\": false} (Content-Type: application/json); GET /health; "
                    "GET /metrics (Prometheus); open / in a browser to type sentences and see translations and "
                    "attention maps. Concurrent requests share model calls. The decode options below are the "
                    "defaults of requests that do not set them; --precision and --cuda-graphs, how the model "
                    f"decodes them all. The API key may come from ${API_KEY_ENV} "
                    "instead of --api-key (which ps would show). See docs/serve.md.",
        allow_abbrev=False)
    p.add_argument("--checkpoint", required=True, nargs="+", metavar="FILE",
                   help="checkpoint written by `aiayn train` or `aiayn average`; several (or an ensemble file from "
                        "`aiayn ensemble`) serve their ensemble, the mean of their next-token probabilities, as "
                        "`aiayn translate` does")
    add_device_argument(p)
    add_arguments(p, ServeConfig)
    add_arguments(p, DecodeConfig, only=SERVE_DECODE + SERVE_MODEL)
    p.set_defaults(func=run, **{name: None for name in SERVE_DECODE if name in CHECKPOINT_FIELDS})  # (``decode_config``)


def _check_defaults(cfg: ServeConfig, decode: DecodeConfig) -> None:
    """A UserError if a request default (a flag, or the checkpoint's own setting) is over the cap the
    service puts on requests: every request that leaves the field out would be answered 422."""
    for default, value, cap in (("beam-size", decode.beam_size, cfg.max_beam), ("alpha", decode.alpha, cfg.max_alpha),
                                ("no-repeat-ngram", decode.no_repeat_ngram, cfg.max_no_repeat_ngram)):
        if value > cap:
            limit = "max-beam" if default == "beam-size" else f"max-{default}"
            raise UserError(f"--{default} {value:g} exceeds --{limit} {cap:g}: every request that leaves it out "
                            f"would be refused; lower --{default} or raise --{limit}")


def run(args: argparse.Namespace) -> int:
    try:
        from aiayn.serve.app import create_app
        from aiayn.serve.server import FORCED_EXIT, make_server
    except ImportError as exc:
        raise UserError(f"`aiayn serve` needs the web stack: pip install 'aiayn[serve]' ({exc})") from exc
    import torch

    from aiayn.decode.translator import Translator
    # the flags, else the model's own settings (an imported model's generation settings), else the defaults
    cfg, decode = from_args(ServeConfig, args), decode_config(args, args.checkpoint, base=DecodeConfig())
    _check_defaults(cfg, decode)
    if not cfg.api_key and os.environ.get(API_KEY_ENV):
        try:
            cfg = replace(cfg, api_key=os.environ[API_KEY_ENV])
        except ConfigError as exc:
            raise UserError(f"${API_KEY_ENV}: {exc}") from None
    if not cfg.model_name:
        cfg = replace(cfg, model_name="+".join(Path(c).name for c in args.checkpoint))
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    app = create_app(Translator.from_checkpoint(args.checkpoint, decode, device=args.device), cfg)
    served = ", ".join(args.checkpoint)
    def banner(port: int) -> str:  # of the port bound (--port 0: the one the system chose)
        return (f"serving {served} on http://{cfg.host}:{port}/ (hosts {','.join(cfg.allowed_hosts)}"
                f"{', API key required' if cfg.api_key else ''})")
    server = make_server(app, cfg, banner, log_level="info")
    server.run()  # (the banner once the port is bound)
    if server.force_exit:  # a second Ctrl-C: the requests in progress were answered 503
        print("aiayn serve: stopped at once (Ctrl-C twice); requests in progress were answered 503", file=sys.stderr)
        return FORCED_EXIT
    return 0
