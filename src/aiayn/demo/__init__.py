"""``aiayn demo``: from raw parallel text to a scored, averaged model and an attention plot, sized
to the machine it runs on (docs/recipe.md).

- ``multi30k``: the demo on Multi30k (the default), and where ``aiayn demo`` starts;
- ``own``: the same steps on your own parallel text (``--train``, ``--valid``, ``--test``);
- ``stages``: the stages both share (prepare, train, average, translate, score, plot);
- ``sizing``: the recipe chosen by the training FLOPs this machine counts in the demo's minutes;
- ``config``: the options (``DemoConfig``) and how long the demo trains (``MINUTES``).
"""
