"""Scoring (§6.1, Table 2): sacreBLEU, chrF and the paper's compound-split tokenized BLEU."""
