"""Data: raw parallel text -> a prepared data directory -> padded batches (§5.1).

* ``aiayn.data.prepare`` / ``aiayn prepare`` (``aiayn.commands.prepare``): train SentencePiece, encode,
  clean, binarize; all-or-nothing output.
* ``aiayn.data.vocab.Tokenizer``: the SentencePiece model with fixed ids pad=0 unk=1 bos=2 eos=3.
* ``aiayn.data.dataset.DataDir`` / ``ParallelData``: the manifest (format documented there) and
  memory-mapped splits; ``aiayn.data.store``: the file layout.
* ``aiayn.data.batching``: ``TokenBatchSampler`` (bounded by ``TokenBounds``, length-grouped,
  resumable, data-parallel), ``collate`` -> ``Batch``, ``batches``.
* ``aiayn.data.stream``: ``BatchStream``, the training batches one optimizer step at a time
  (epochs, BPE-dropout, corpus weights, prefetch, the data position a checkpoint keeps).
"""
