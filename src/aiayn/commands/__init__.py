"""The sub-commands of ``aiayn``, one module each, named as the user types them (``import`` is
``import_``, ``upgrade-checkpoint`` is ``upgrade_checkpoint``).

Each module holds a command's options and the glue that calls the library: ``register(subparsers)``
adds its parser and sets ``func`` to the function that runs it. ``aiayn.cli`` lists them.
"""
