"""``aiayn demo``: Multi30k end to end (``aiayn.demo.multi30k``); the options of both demos, this one and
``aiayn parse demo``, come from their configuration's fields."""
from __future__ import annotations

import argparse
import dataclasses

from aiayn.config import ConfigError, add_arguments, doc_help, from_args
from aiayn.demo import multi30k
from aiayn.demo.config import DemoConfig


def config_with_sets(cls, args):
    """A demo's configuration from the parsed ``args``, its ``sets`` field from the repeatable --set
    (an empty one is refused, as ``aiayn train`` refuses it, not dropped in the joining)."""
    if any(not s.strip(" ,") for s in args.set or ()):
        raise ConfigError("--set '': expected section.field=value")
    cfg = from_args(cls, args)
    return dataclasses.replace(cfg, sets=",".join(args.set)) if args.set else cfg


def add_demo_arguments(p, cls, set_example: str, skip: tuple[str, ...] = ()) -> None:
    """Every field of the demo configuration ``cls`` as an option (but ``skip``), ``sets`` as a
    repeatable --set."""
    add_arguments(p, cls, only=tuple(f.name for f in dataclasses.fields(cls) if f.name not in ("sets", *skip)))
    p.add_argument("--set", action="append", metavar="SECTION.FIELD=VALUE",
                   help=f"override a field of the recipe (repeatable), e.g. {set_example}")


def run(args) -> int:
    multi30k.run_demo(config_with_sets(DemoConfig, args))
    return 0


OWN_FILES = ("train", "valid", "test")  # DemoConfig's fields of two files each: --train SOURCE TARGET


def register(sub) -> None:
    p = sub.add_parser("demo", help="Multi30k, or your own parallel text (--train, --valid, --test), end to end: "
                                    "prepare, train, average, translate, score, plot",
                       description=doc_help(multi30k.__doc__), formatter_class=argparse.RawDescriptionHelpFormatter,
                       allow_abbrev=False)
    add_demo_arguments(p, DemoConfig, "--set model.p_drop=0.2 --set train.seed=2", skip=OWN_FILES)
    help_of = {f.name: f.metadata["help"] for f in dataclasses.fields(DemoConfig)}
    for name in OWN_FILES:
        p.add_argument(f"--{name}", nargs=2, metavar=("SOURCE", "TARGET"), default=(), help=help_of[name])
    p.set_defaults(func=run)
