"""Checkpoints to and from other toolkits, every weight copied and nothing re-trained.

- ``ct2_export``: a checkpoint as a CTranslate2 model directory (``aiayn export``);
- ``hf_export``: a checkpoint as a Hugging Face ``MarianMTModel`` directory (``aiayn export --format hf``);
- ``hf_import``: a ``MarianMTModel`` directory as a checkpoint (``aiayn import --format hf``), reading
  the directory through ``marian_dir`` (every file checked before use) and its vocabulary through
  ``marian_vocab`` (Marian's ids in aiayn's order);
- ``export_dir``: the folder both exports write, whole or not at all.
"""
