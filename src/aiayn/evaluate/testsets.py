"""Test sets by name through sacreBLEU's own downloader (statmt.org and the other sources it
knows, checked by its MD5 sums, kept in its cache: ``$SACREBLEU``, else ``~/.sacrebleu``).

``wmt14`` is newstest2014 as the paper scores it: sacreBLEU's ``wmt14/full`` (3,003 sentences for
En-De; sacreBLEU's own ``wmt14`` is the 2,737-sentence filtered version). Any other name is
sacreBLEU's (``sacrebleu --list``).
"""
from __future__ import annotations

from aiayn.errors import UserError

ALIASES = {"wmt14": "wmt14/full", "newstest2014": "wmt14/full", "newstest2013": "wmt13"}


def fetch_testset(name: str, langpair: str) -> tuple[list[str], list[str], str]:
    """The source lines, the (first) reference lines and sacreBLEU's name of test set ``name``
    in ``langpair`` (e.g. "en-de"), downloaded into sacreBLEU's cache when not there yet."""
    from sacrebleu.dataset import DATASETS
    full = ALIASES.get(name, name)
    if full not in DATASETS:
        raise UserError(f"--testset {name}: not a test set sacreBLEU knows (wmt14, wmt13, wmt20, ...: `sacrebleu --list`)")
    data = DATASETS[full]
    if langpair not in data.langpairs:
        raise UserError(f"--testset {name} ({full}) has no {langpair}; it has {', '.join(sorted(data.langpairs))}")
    try:
        src = list(data.source(langpair))
        ref = [refs[0].rstrip("\n") for refs in data.references(langpair)]
    except (OSError, SystemExit) as exc:  # sacreBLEU exits after logging a bad MD5 or an SSL error
        raise UserError(f"--testset {name}: sacreBLEU could not fetch {full} {langpair} into {data._outdir} ({exc!r}); "
                        f"check the network, or remove {data._rawdir} and run again") from None
    if len(src) != len(ref):
        raise UserError(f"--testset {name}: {len(src)} source lines but {len(ref)} references in {data._outdir}")
    return src, ref, full
