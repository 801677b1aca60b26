"""The translation service: HTTP JSON API and web page (``app``, ``page``) over a batching worker (``batcher``)."""
